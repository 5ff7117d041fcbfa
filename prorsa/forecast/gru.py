"""``gru``: a small torch GRU over the recent history of aggregate features.

The network reads the last ``window`` ticks of standardised aggregate features and outputs,
for every target and horizon, the normalised target's mean, p50 and p90 (trained with
squared error plus pinball losses). It is small enough to train on CPU in well under a
minute for the shipped data and is deterministic for a seed: training runs on one thread
with ``torch.manual_seed`` and ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from prorsa.errors import ConfigError
from prorsa.forecast.aggregate import conformal_shift, read_conformal
from prorsa.forecast.base import Forecaster, Point, Quantiles, denormalise, register
from prorsa.forecast.dataset import ForecastDataset
from prorsa.forecast.features import aggregate_feature_names
from prorsa.forecast.types import DEFAULT_HORIZONS, QUANTILES, TARGETS

# Output heads: the point forecast, then one per quantile level (pinball loss).
_HEADS = 1 + len(QUANTILES)


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError(
            "the gru forecaster needs torch", hint="pip install 'prorsa[torch]'"
        ) from None
    return torch


@contextmanager
def _deterministic(seed: int):
    """One thread, deterministic kernels and a seeded generator; restored afterwards."""
    torch = _torch()
    threads = torch.get_num_threads()
    was = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield torch
    finally:
        torch.use_deterministic_algorithms(was)
        torch.set_num_threads(threads)


def _build(torch, n_in: int, hidden: int, n_out: int):
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = torch.nn.GRU(n_in, hidden, batch_first=True)
            self.head = torch.nn.Linear(hidden, _HEADS * n_out)

        def forward(self, x):
            _, h = self.gru(x)
            return self.head(h[-1]).view(-1, _HEADS, n_out)

    return Net()


@register("gru")
class GRUForecaster(Forecaster):
    """GRU sequence model over aggregate-feature history (point, p50, p90).

    Args:
        window: ticks of history the network reads.
        hidden: GRU state size.
        epochs / batch_size / learning_rate: Adam training settings.
    """

    provides_quantiles = True

    def __init__(
        self,
        horizons: Sequence[float] = DEFAULT_HORIZONS,
        seed: int = 0,
        window: int = 32,
        hidden: int = 32,
        epochs: int = 60,
        batch_size: int = 256,
        learning_rate: float = 1e-3,
    ) -> None:
        super().__init__(horizons, seed)
        self.window = window
        self.hidden = hidden
        self.epochs = epochs
        self.batch_size = batch_size
        self.learning_rate = learning_rate

    def _fit(self, data: ForecastDataset | None) -> None:
        if self.window < 1 or self.hidden < 1 or self.epochs < 0 or self.batch_size < 1:
            raise ConfigError("gru: window, hidden and batch_size must be >= 1, epochs >= 0")
        # Its quantile heads are fitted in-sample; shifts come only from validation runs
        # (:func:`~prorsa.forecast.validation_fit.fit_on_validation`).
        self.conformal_: dict = {}
        ticks = data.ticks
        x = ticks[data.feature_names].to_numpy(float)
        self.x_mean_ = np.nanmean(x, axis=0)
        std = np.nanstd(x, axis=0)
        self.x_std_ = np.where(std > 1e-9, std, 1.0)
        y = self._targets_matrix(ticks, self.horizons_).reshape(len(ticks), -1)
        self.y_mean_ = y.mean(axis=0)
        ystd = y.std(axis=0)
        self.y_std_ = np.where(ystd > 1e-9, ystd, 1.0)
        xs = self._standardise(x)
        ys = ((y - self.y_mean_) / self.y_std_).astype(np.float32)
        # Each run is prefixed by window-1 zero rows so every tick has a full window.
        pad = self.window - 1
        blocks, starts, offset = [], [], 0
        for _, idx in ticks.groupby("run_id", sort=False).indices.items():
            blocks += [np.zeros((pad, xs.shape[1]), np.float32), xs[idx]]
            starts.append(offset + np.arange(len(idx)))
            offset += pad + len(idx)
        order = np.concatenate(
            [idx for idx in ticks.groupby("run_id", sort=False).indices.values()]
        )
        padded = np.vstack(blocks)
        start = np.concatenate(starts)
        target = ys[order]
        with _deterministic(self.seed) as torch:
            net = _build(torch, xs.shape[1], self.hidden, ys.shape[1])
            opt = torch.optim.Adam(net.parameters(), lr=self.learning_rate)
            gen = torch.Generator().manual_seed(self.seed)
            xp, yt = torch.from_numpy(padded), torch.from_numpy(target)
            steps = torch.arange(self.window)
            levels = torch.tensor(QUANTILES).view(1, len(QUANTILES), 1)
            for _ in range(self.epochs):
                perm = torch.randperm(len(start), generator=gen)
                for b in range(0, len(perm), self.batch_size):
                    sel = perm[b : b + self.batch_size]
                    rows = torch.from_numpy(start)[sel].view(-1, 1) + steps.view(1, -1)
                    out = net(xp[rows])
                    y = yt[sel]
                    diff = y.unsqueeze(1) - out[:, 1:]
                    pin = torch.maximum(levels * diff, (levels - 1) * diff).mean()
                    loss = ((out[:, 0] - y) ** 2).mean() + pin
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            self.weights_ = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
        self._net = None

    def _standardise(self, x: np.ndarray) -> np.ndarray:
        return np.nan_to_num((x - self.x_mean_) / self.x_std_).astype(np.float32)

    def _network(self):
        if getattr(self, "_net", None) is None:
            torch = _torch()
            net = _build(torch, len(self.x_mean_), self.hidden, len(self.y_mean_))
            net.load_state_dict(
                {k: torch.from_numpy(np.asarray(v)) for k, v in self.weights_.items()}
            )
            net.eval()
            self._net = net
        return self._net

    def _reset_stream(self) -> None:
        self._history: deque[np.ndarray] = deque(maxlen=self.window)

    def _update(self) -> None:
        self._history.append(self._standardise(self.current_features()[None, :])[0])

    def _predict(self, horizons: tuple[float, ...]) -> tuple[Point, Quantiles]:
        torch = _torch()
        net = self._network()
        seq = np.zeros((self.window, len(self.x_mean_)), np.float32)
        hist = np.asarray(self._history)
        seq[self.window - len(hist) :] = hist
        with torch.inference_mode():
            out = net(torch.from_numpy(seq[None])).numpy()[0]  # heads x (targets * horizons)
        out = out * self.y_std_ + self.y_mean_
        out = out.reshape(_HEADS, len(TARGETS), len(self.horizons_))
        scale = self.live_scale()
        cols = [self.horizons_.index(h) for h in horizons]
        shifts = getattr(self, "conformal_", {})
        tables = []
        for k, alpha in enumerate((None, *QUANTILES)):
            table = {}
            for i, t in enumerate(TARGETS):
                raw = out[k, i, cols] + conformal_shift(shifts, alpha, t, self.horizons_, horizons)
                table[t] = denormalise(raw, t, horizons, scale)
            tables.append(table)
        return tables[0], dict(zip(QUANTILES, tables[1:], strict=True))

    def _get_state(self, path: Path) -> dict:
        arrays = {f"w:{k}": v for k, v in self.weights_.items()}
        arrays.update(
            x_mean=self.x_mean_, x_std=self.x_std_, y_mean=self.y_mean_, y_std=self.y_std_
        )
        np.savez_compressed(path / "gru.npz", **arrays)
        return {"weights": "gru.npz", "conformal": getattr(self, "conformal_", {})}

    def _set_state(self, state: dict, path: Path) -> None:
        from prorsa.errors import InputError
        from prorsa.forecast.model_folder import model_file, read_npz, state_field

        name = state_field(state, "weights", str, source=path)
        file = model_file(path, name, field="state.weights")
        arrays = read_npz(file, ("x_mean", "x_std", "y_mean", "y_std"))
        self.weights_ = {k[2:]: v for k, v in arrays.items() if k.startswith("w:")}
        self.x_mean_, self.x_std_ = arrays["x_mean"], arrays["x_std"]
        self.y_mean_, self.y_std_ = arrays["y_mean"], arrays["y_std"]
        self._net = None
        width = len(aggregate_feature_names(self.lags_, self.tasks_))
        outputs = len(TARGETS) * len(self.horizons_)
        for name, values in (("y_mean", self.y_mean_), ("y_std", self.y_std_)):
            if len(values) != outputs:  # else predict fails to reshape, mid-run
                raise InputError(
                    f"{name} has {len(values)} outputs; {len(TARGETS)} targets x "
                    f"{len(self.horizons_)} fitted horizons need {outputs}",
                    source=str(file),
                    hint="fitted.horizons must be the horizons the network was trained for",
                )
        if len(self.x_mean_) != width:
            raise InputError(
                f"model expects {len(self.x_mean_)} input features, this prorsa builds {width}",
                source=str(file),
                hint="retrain it (`prorsa forecast ship` regenerates the shipped models)",
            )
        # After the outputs' check: a horizon list that does not fit the network says so
        # there, rather than as a shift list of the wrong length.
        self.conformal_ = read_conformal(state, path, len(self.horizons_))
        try:
            self._network()  # weights that do not fit the network fail here, not mid-run
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise InputError(
                f"the weights do not fit a GRU of hidden size {self.hidden}: "
                f"{str(exc).splitlines()[0]}",
                source=str(file),
                hint="retrain it (`prorsa forecast ship` regenerates the shipped models)",
            ) from None
