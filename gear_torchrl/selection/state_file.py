"""Sampler checkpoints: a state dict's tensors as raw files with checksums, the rest in a JSON manifest.

Loading is two steps, so nothing changes until everything is known good:
``read_checkpoint`` reads and checks (``checked_state_dict``), ``_assign``
takes the checked state. ``GearStorageCheckpointer`` calls
``check_checkpoint`` on the buffer's sampler before it restores the storage:
TorchRL's ``rb.loads`` restores the storage first, and a sampler state found
damaged afterwards would leave new rows behind old priorities.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from gear_torchrl.errors import CheckpointError, UnverifiedCheckpointWarning
from gear_torchrl.selection.rules import spec_from_json
from gear_torchrl.store.persistence import read_checkpoint, write_checkpoint

SAMPLER_FORMAT = "gear_torchrl.sampler/1"
_PICKLED_STATE = "sampler_state.pt"  # before checksums, samplers with small states saved this


class StateDictFile:
    """``dumps``/``loads``/``load_state_dict``/``check_checkpoint`` over ``state_dict()``.

    A subclass gives ``state_dict()`` (tensors and JSON scalars),
    ``checked_state_dict(state, rows)`` (raises CheckpointError naming the
    problem, changes nothing) and ``_assign(state)`` (takes a checked state).
    """

    _state_file = "sampler_state.json"

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """``state`` checked against this sampler; ``rows``: how many rows the storage restores with it."""
        raise NotImplementedError

    def _assign(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._assign(self.checked_state_dict(state_dict))

    def dumps(self, path: str | Path) -> None:
        state = self.state_dict()
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        fields = {"kind": type(self).__name__, **{k: v for k, v in state.items() if k not in tensors}}
        write_checkpoint(path, self._state_file, SAMPLER_FORMAT, fields, tensors)
        self._dumped(Path(path), state)

    def _dumped(self, path: Path, state: dict[str, Any]) -> None:
        """After ``dumps`` wrote ``state`` at ``path``: a subclass adds other libraries' files over the same data."""

    def _foreign_state(self, path: Path) -> dict[str, Any] | None:
        """The state another library's files at ``path`` hold, when they are newer than ours (None: read ours)."""
        return None

    def loads(self, path: str | Path) -> None:
        self._assign(self.read_checkpoint(path))

    def check_checkpoint(self, path: str | Path, rows: int | None = None) -> None:
        """Raise CheckpointError unless ``loads(path)`` would succeed next to ``rows`` restored rows."""
        self.read_checkpoint(path, rows)

    def read_checkpoint(self, path: str | Path, rows: int | None = None) -> dict[str, Any]:
        """The state saved at ``path``, read in full and checked; this sampler does not change."""
        path = Path(path)
        foreign = self._foreign_state(path)
        if foreign is not None:
            return self.checked_state_dict(foreign, rows)
        if not (path / self._state_file).exists():
            return self._read_pickled(path, rows)

        def checked(fields: dict, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
            kind = fields.get("kind")
            if kind is not None and kind != type(self).__name__:
                raise CheckpointError(f"{path} holds the state of a {kind}, this sampler is a {type(self).__name__}")
            saved = {k: v for k, v in fields.items() if k != "kind"}
            return self.checked_state_dict(self._with_inner(path, {**saved, **tensors}, rows), rows)

        layout = self._unlisted_layout()
        return read_checkpoint(
            path,
            self._state_file,
            SAMPLER_FORMAT,
            checked,
            unverified_formats=() if layout is None else (None,),
            unlisted=layout,
        )

    def _with_inner(self, path: Path, saved: dict[str, Any], rows: int | None) -> dict[str, Any]:
        """``saved`` plus the states of samplers this one wraps (saved in subdirectories of ``path``)."""
        return saved

    def _unlisted_layout(self) -> dict[str, tuple[torch.dtype, list[int]]] | None:
        """The tensor files of a manifest written before checksums, which listed none (None: there were none)."""
        return None

    def _read_pickled(self, path: Path, rows: int | None) -> dict[str, Any]:
        """A state saved before checksums (``torch.save``): loaded with a warning, checked all the same."""
        if not (path / _PICKLED_STATE).exists():
            found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
            saved = f"its files {found} are another sampler's" if found else "the buffer's sampler saved nothing"
            raise CheckpointError(
                f"no {type(self).__name__} state at {path} (missing {self._state_file}): {saved}. Load the "
                "checkpoint into a buffer with the sampler that saved it, or load the rows alone "
                "(rb.storage.loads(<checkpoint>/'storage')) and give this sampler its state afresh"
            )
        return self.checked_state_dict(load_pickled(path / _PICKLED_STATE), rows)


def load_pickled(path: Path) -> Any:
    """What ``torch.save`` wrote at ``path`` before checkpoints carried checksums, with a warning saying so."""
    warnings.warn(
        f"{path} was written before checkpoints carried checksums: its values are checked, but damaged "
        "bytes cannot be detected. Save it again to add them.",
        UnverifiedCheckpointWarning,
        stacklevel=4,
    )
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001  (whatever unpickling raises, the file is damaged)
        raise CheckpointError(f"{path} does not load ({err}): it is damaged") from None


# -- a shard owner's cores, saved with the rows they follow ------------------------------------------
ROWS_STATE_FORMAT = "gear_torchrl.selector_rows/1"
_ROWS_STATE_FILE = "selector.json"
_FINITE_NONNEGATIVE = ("mass", "row_mass")


def save_rows_state(directory: str | Path, spec: Any, state: dict[str, Any]) -> None:
    """A core's ``export_rows`` state, next to the spec that makes the core again."""
    flat = _flatten(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    fields = {"spec": spec.to_json(), "scalars": {k: v for k, v in flat.items() if k not in tensors}}
    write_checkpoint(directory, _ROWS_STATE_FILE, ROWS_STATE_FORMAT, fields, tensors)


def read_rows_state(directory: str | Path, rows: int) -> tuple[Any, dict[str, Any]]:
    """The spec and ``import_rows`` state saved at ``directory``, checked against ``rows`` restored rows."""

    def checked(fields: dict, tensors: dict[str, torch.Tensor]) -> tuple[Any, dict[str, Any]]:
        try:
            spec = spec_from_json(fields.get("spec"))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{directory}: the saved selection is damaged ({exc})") from None
        for name, t in tensors.items():
            _check_rows_tensor(name, t, rows)
        return spec, _unflatten({**fields.get("scalars", {}), **tensors})

    return read_checkpoint(directory, _ROWS_STATE_FILE, ROWS_STATE_FORMAT, checked)


def _check_rows_tensor(name: str, t: torch.Tensor, rows: int) -> None:
    leaf = name.rsplit("__", 1)[-1]
    if leaf == "waiting":  # positions of rows still queued: distinct, each a restored row
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= rows or t.unique().numel() != t.numel()):
            raise CheckpointError(f"the saved queue names rows outside the {rows} restored, or one twice: damaged")
        return
    if t.shape[:1] != (rows,):
        raise CheckpointError(f"saved {name} holds {t.shape[0] if t.ndim else 0} rows, the shard restores {rows}")
    if t.is_floating_point() and bool(t.isnan().any()):
        raise CheckpointError(f"saved {name} holds NaN: the checkpoint is damaged")
    if leaf in _FINITE_NONNEGATIVE and not bool((torch.isfinite(t) & (t >= 0)).all()):
        raise CheckpointError(f"saved {name} holds a negative or infinite mass: the checkpoint is damaged")
    if not t.is_floating_point() and bool((t < 0).any()):
        raise CheckpointError(f"saved {name} holds a negative count: the checkpoint is damaged")


def _flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in state.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}__"))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, v in flat.items():
        *parents, leaf = name.split("__")
        at = state
        for p in parents:
            at = at.setdefault(p, {})
        at[leaf] = v
    return state
