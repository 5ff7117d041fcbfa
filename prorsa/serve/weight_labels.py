"""Trainers' names for weight versions.

The service numbers weight versions 0, 1, 2 ... (what engines stamp on every token and
what never goes backwards). vLLM's RL routes treat a version as an opaque label instead
(``/finish_weight_update {"weight_version": "step-12"}``, ``/update_weight_version``,
``/weight_info``), so a trainer may name a version anything. A label given with an
update names the next number; a number (or a string of ASCII digits) is the number
itself. Each label names one version: reusing one for a later version would make two sets
of weights answer to the same name.
"""

from __future__ import annotations

import re

from prorsa.errors import InputError

#: Longest label kept (it goes into every response's spans).
MAX_LABEL_CHARS = 128
_NUMBER = re.compile(r"[0-9]+")


def is_number(label: str) -> bool:
    """A label of ASCII digits only (``str.isdigit`` also takes ``"²"``, which ``int``
    refuses), short enough for ``int`` (which refuses 4,300 digits and more)."""
    return len(label) <= MAX_LABEL_CHARS and _NUMBER.fullmatch(label) is not None


class WeightLabels:
    """Version number <-> label, from version 0 (labelled ``"0"``) on."""

    def __init__(self) -> None:
        self._label_of: dict[int, str] = {0: "0"}
        self._version_of: dict[str, int] = {"0": 0}

    def resolve(self, requested: int | str | None, current: int) -> tuple[int, str]:
        """The version number and label an update to ``requested`` stamps (None: the next
        number, labelled by it); InputError (field ``version``) when the number would
        not be above ``current`` or the label is not usable."""
        if requested is None:
            return current + 1, str(current + 1)
        if isinstance(requested, str) and is_number(requested):
            requested = int(requested)
        if isinstance(requested, int) and not isinstance(requested, bool):
            if requested <= current:
                raise InputError(
                    f"weight version {requested} is not above the current {current}",
                    field="version",
                    hint="weight versions never go backwards",
                )
            return requested, self._free(str(requested), requested)
        if isinstance(requested, str):
            return current + 1, self._free(requested, current + 1)
        raise InputError(
            f"version must be an integer or a label, got {requested!r}", field="version"
        )

    def stamp(self, version: int, label: str) -> None:
        """Record that ``version`` is served, named ``label`` (from :meth:`resolve`)."""
        self._label_of[version] = label
        self._version_of[label] = version

    def relabel(self, version: int, label: str) -> None:
        """Name the version already served ``label`` (vLLM's ``/update_weight_version``);
        its earlier name stays a name of it. A label of digits is a version number, so
        only the version's own number is accepted as one."""
        if is_number(label) and int(label) != version:
            raise InputError(
                f"label {label!r} is a version number, not version {version}'s",
                field="version",
                hint="a label of digits names that version; use a name with a letter",
            )
        self.stamp(version, self._free(label, version))

    def label(self, version: int | str) -> str:
        """The label of ``version`` (its number when it never got one); an engine's stamp
        that is not a number (vLLM's ``"default"``) is kept as it is."""
        if isinstance(version, str):
            if not is_number(version):
                return version
            version = int(version)
        return self._label_of.get(version, str(version))

    def _free(self, label: str, version: int) -> str:
        if (
            not label
            or label != label.strip()
            or len(label) > MAX_LABEL_CHARS
            or not label.isprintable()
        ):
            raise InputError(
                f"a weight version label must be 1-{MAX_LABEL_CHARS} printable characters "
                f"without surrounding spaces, got {label!r}",
                field="version",
            )
        owner = self._version_of.get(label)
        if owner is not None and owner != version:
            raise InputError(
                f"weight version label {label!r} already names version {owner}",
                field="version",
                hint="give each set of weights its own label",
            )
        return label
