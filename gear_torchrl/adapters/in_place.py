"""TorchRL's in-place writes into a ``GearStorage`` (``rb.set_``, ``update_if_present``) and its own checkpointers,
which read and write every row slot through ``_storage``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchrl.data.replay_buffers.storages import Storage, TensorStorage

from gear_torchrl.adapters.checkpointer import GearStorageCheckpointer
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.table_spec import Data, NestedKey


class InPlaceWrites(TensorStorage):
    """What a local CPU store allows of TorchRL's writes in place, and refuses elsewhere, saying why."""

    _shard: Shard
    shared: bool
    device: torch.device

    if TYPE_CHECKING:  # GearStorage's: a copy in another process refuses writes

        def check_writable_here(self) -> None: ...

    def _bump_mutation_revision(self) -> None:
        """TorchRL calls this after writing in place into ``storage[:]`` (``rb.set_``, ``set_at_``, ``update_``).

        Over local CPU rows those writes went through the views ``get`` returned: the
        episode index is re-derived from the flags they may have changed. Anywhere
        else ``storage[:]`` was a copy, and the write is refused rather than lost.
        """
        if not self._shard.slice_views_possible:
            raise NotImplementedError(
                f"rb.set_ / set_at_ / update_ write in place into storage[:], which for this GearStorage "
                f"({'shared' if self.shared else f'batches on {self.device}'}) is a copy: the write did not "
                "reach the stored rows. Write rows with rb.extend / rb[index] = data instead"
                + (" (a shared store takes appends only)." if self.shared else ".")
            )
        self._rows_changed_in_place()

    def _conditional_patch_leaf(self, key: NestedKey) -> torch.Tensor:
        """The stored column ``key``, which TorchRL's ``rb.update_if_present`` patches in place."""
        self.check_writable_here()
        if self.shared:
            raise NotImplementedError(
                "rb.update_if_present writes rows in place; a shared GearStorage takes "
                "appends only (another process could be reading the rows)"
            )
        column = self._shard.column(key)
        if column is None:
            raise KeyError(
                f"key {key!r} is not stored; conditional patches can only target stored keys "
                f"({'nothing is stored yet' if self._shard.table is None else self._shard.table.keys})"
            )
        return column

    def _apply_conditional_patch(self, index: torch.Tensor, patch: dict[NestedKey, torch.Tensor]) -> None:
        rows = tuple(index.unbind(-1)) if index.ndim > 1 else (index,)
        for key, value in patch.items():
            self._conditional_patch_leaf(key)[rows] = value
        self._rows_changed_in_place()

    def _rows_changed_in_place(self) -> None:
        self._shard.after_inplace_write()
        self._note_mutation()

    def _note_mutation(self) -> None:
        Storage._bump_mutation_revision(self)

    def loads(self, path: Any) -> None:
        foreign = not isinstance(self.checkpointer, GearStorageCheckpointer)
        if foreign and self.initialized:  # TorchRL's copy every slot in through ``_storage``
            self._shard.fill_unwritten()
        self.checkpointer.loads(self, path)
        if foreign:
            self._rows_changed_in_place()
        else:
            self._note_mutation()

    @property
    def _storage(self) -> Data:  # type: ignore[override]  # TorchRL's is the data; here, views of the columns
        """Every row slot as views of the columns (``[max_size]``), where TorchRL's checkpointers look.

        Only a local store on the CPU has such views; elsewhere this is an AttributeError
        that says why (TorchRL's ``FlatStorageCheckpointer`` and its kin need them).
        """
        if not self._shard.slice_views_possible or self._shard.table is None:
            raise AttributeError(
                "GearStorage._storage (what TorchRL's own checkpointers read and write) exists only for a "
                "local store with rows on the CPU that holds data; use the default GearStorageCheckpointer"
            )
        return self._shard.slice_views(slice(None), all_slots=True)

    def _init(self, row: Data) -> None:  # type: ignore[override]  # as LazyTensorStorage's: laid out for a row
        """Lay the columns out for rows like ``row``: TorchRL's checkpointers restore into a new storage so,
        then write every slot through ``_storage``."""
        self._shard.write(0, row, append=False)
        self._shard.clear()
        self._shard.fill_unwritten()
