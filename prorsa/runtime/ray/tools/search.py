"""Text search over a local corpus with BM25 (Okapi, k1=1.5, b=0.75), written out in full.

The default corpus is this project's own documentation: every module docstring of the
installed ``prorsa`` package, plus ``README.md`` and ``docs/*.md`` when running from a
source checkout, split into paragraphs. Nothing is downloaded; another folder of ``.md`` /
``.txt`` files can be searched instead.
"""

from __future__ import annotations

import ast
import math
import re
import time
from collections import Counter
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from prorsa.runtime.ray.tools.base import ToolResult

_WORD = re.compile(r"[a-z][a-z0-9_]+")


def words(text: str) -> list[str]:
    """Lower-case word tokens (two characters or more)."""
    return _WORD.findall(text.lower())


@cache
def project_corpus() -> tuple[str, ...]:
    """Paragraphs of the project's docstrings and docs (cached; about 0.2 s to build)."""
    import prorsa

    package = Path(prorsa.__file__).resolve().parent
    texts: list[str] = []
    for path in sorted(package.rglob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        if doc:
            texts.append(doc)
    root = package.parent
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return tuple(_paragraphs(texts))


def folder_corpus(folder: str | Path) -> tuple[str, ...]:
    """Paragraphs of every ``.md`` and ``.txt`` file under ``folder``."""
    paths = sorted(p for p in Path(folder).rglob("*") if p.suffix in (".md", ".txt"))
    return tuple(_paragraphs(p.read_text(encoding="utf-8", errors="replace") for p in paths))


def _paragraphs(texts) -> list[str]:
    out = []
    for text in texts:
        for block in re.split(r"\n\s*\n", text):
            block = " ".join(block.split())
            if len(words(block)) >= 5:
                out.append(block)
    return out


class BM25:
    """Okapi BM25 over a list of documents.

    Args:
        documents: the texts to search.
        k1, b: the usual saturation and length-normalisation parameters.
    """

    def __init__(self, documents: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.documents = list(documents)
        self.k1 = k1
        self.b = b
        counts = [Counter(words(d)) for d in self.documents]
        self.lengths = [sum(c.values()) for c in counts]
        self.avg_length = sum(self.lengths) / max(len(self.lengths), 1)
        self.postings: dict[str, list[tuple[int, int]]] = {}
        for doc, c in enumerate(counts):
            for term, tf in c.items():
                self.postings.setdefault(term, []).append((doc, tf))
        n = len(self.documents)
        self.idf = {
            t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()
        }

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """Best ``k`` ``(document index, score)`` pairs, highest first; no hit, no entry."""
        scores: dict[int, float] = {}
        for term in set(words(query)):
            idf = self.idf.get(term)
            if idf is None:
                continue
            for doc, tf in self.postings[term]:
                norm = tf + self.k1 * (1 - self.b + self.b * self.lengths[doc] / self.avg_length)
                scores[doc] = scores.get(doc, 0.0) + idf * tf * (self.k1 + 1) / norm
        return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]

    @property
    def vocabulary(self) -> list[str]:
        """Indexed terms, sorted (the agent loop draws queries from them)."""
        return sorted(self.postings)


class SearchTool:
    """Return the top passages for ``args["query"]``.

    Args:
        corpus_dir: folder of ``.md``/``.txt`` files; None searches the project's docs.
        top_k: passages per answer.
    """

    name = "search"

    def __init__(self, corpus_dir: str | Path | None = None, top_k: int = 3) -> None:
        self.corpus_dir = corpus_dir
        self.top_k = top_k
        documents = folder_corpus(corpus_dir) if corpus_dir else project_corpus()
        if not documents:
            from prorsa.errors import ConfigError

            raise ConfigError(f"search corpus {corpus_dir or 'prorsa docs'} has no passages")
        self.index = BM25(documents)

    async def call(self, args: dict[str, object]) -> ToolResult:
        query = str(args.get("query", ""))
        started = time.perf_counter()
        hits = self.index.search(query, self.top_k)
        if not hits:
            text = f"no passage matches {query!r}"
        else:
            text = "\n".join(
                f"[{rank}] ({score:.2f}) {self.index.documents[doc][:600]}"
                for rank, (doc, score) in enumerate(hits, 1)
            )
        return ToolResult(text, ok=bool(hits), exec_s=time.perf_counter() - started)
