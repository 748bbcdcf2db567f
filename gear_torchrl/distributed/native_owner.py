"""An owner's answers without the interpreter: uniform rows and windows, drawn, read and sent by the extension.

A learner asks for uniform rows read back at once with SAMPLE_ROWS. While
such requests come, the connection's thread stays in ``_C.serve_samples``
(the GIL released): it opens a read section in the store's control segment
as ``commit_log`` does, draws from the learner's seed exactly as the selector
would, copies the rows out and sends the reply. It hands back to Python the
request it does not answer (an empty store, rows a dead writer left, a new
layout, a revoked read, a request out of bounds: Python answers those in
full, errors included), any other op (unread), and, now and then, a turn to
catch the view up with the store's records. A learner reading the shard its
own process serves gets the same answer into its batch (``answer_in_place``):
one native call where the Python path takes a pick, a read section and a gather.

Uniform windows (SAMPLE_WINDOWS) need the view's episode index and the
selector's tree of windows per episode: the first request of a rule is
answered in Python, which arms the rule; the extension then draws the next
ones from that state for as long as the view is current (nothing published or
evicted since it caught up), and hands back a turn to catch up otherwise. In
place, the learner's view catches up first whenever the store moved on.

Prioritized rows and windows (SAMPLE_PRIORITIZED, POST_UPDATE) are drawn from
and applied to the shard's shared core, under its lock: rows once the core
followed the store (the extension follows it for rows); windows, as uniform
windows, while the view whose episodes the core's trees were derived from is
current. One prioritized rule is armed at a time: the last one Python answered.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import torch

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.shard_client import Ask, rule_meta
from gear_torchrl.distributed.shard_view import ShardView
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.errors import ReadRevokedError, StoreClosedError
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.priorities import PrioritySelector, PrioritySpec
from gear_torchrl.selection.priority_windows import PriorityWindowSelector, PriorityWindowSpec, window_keys
from gear_torchrl.selection.windows import WindowSelector, WindowSpec

# why _C.serve_samples returned (csrc/net/owner.h ServeCode)
_NEXT_IS_OTHER, _SERVE_IN_PYTHON, _CATCH_UP = _C.SERVE_NEXT_IS_OTHER, _C.SERVE_IN_PYTHON, _C.SERVE_CATCH_UP
CATCH_UP_S = 1.0  # the view replays the records published meanwhile at least this often

# (control segment header, this connection's reader slot, the columns of a layout, that layout's version): the
# store as every native answer takes it, first
_Source = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int]
_WindowRule = Any  # _C.WindowRule: csrc/net/owner.h WindowRule, its fields by name
_PriorityRule = Any  # _C.PriorityRule: csrc/net/owner.h PriorityRule, its fields by name
_PriorityWindowRule = Any  # _C.PriorityWindowRule: csrc/net/owner.h PriorityWindowRule, its fields by name
_Armed = tuple[bytes, dict[str, Any], SelectionSpec]  # an armed rule: its JSON as sent, parsed, and its spec


class NativeOwner:
    """One view's SAMPLE_ROWS, SAMPLE_WINDOWS, SAMPLE_PRIORITIZED and POST_UPDATE (a connection's, or this
    process's own learner's), answered through the view's reader slot."""

    def __init__(self, view: ShardView) -> None:
        self.view = view
        self._source: _Source | None = None
        self._caught_up = time.monotonic()  # when answer_in_place last let the view catch up
        self._windows: tuple[bytes, dict[str, Any], WindowSpec] | None = None  # the armed rules: JSON, as sent
        self._priorities: _Armed | None = None

    def serve(self, conn: socket.socket) -> Message | None:
        """Answer SAMPLE_ROWS and the armed rules' SAMPLE_WINDOWS and SAMPLE_PRIORITIZED until another op is
        next (None: read it as usual) or one needs Python (returned, as a request to answer)."""
        log = self.view.shared.log
        caught_up = False
        if self.view.shared.rates.has_rule:  # draws under a rate limiter count: Python answers them (pick)
            return None
        while not log.reading:
            source = self._mapped()
            if source is None:
                return None
            priorities = self._priority_rule()
            code, count, seed, num_columns, answered, op, arrays = _C.serve_samples(
                conn.fileno(),
                *source,
                log.seen_seq,
                log.num_records // 4,
                CATCH_UP_S,
                self._window_rule(),
                priorities if isinstance(self._priority_spec, PrioritySpec) else None,
                priorities if isinstance(self._priority_spec, PriorityWindowSpec) else None,
            )
            if code == _NEXT_IS_OTHER:
                return None
            if code == _SERVE_IN_PYTHON and op == Op.POST_UPDATE and self._priorities is not None:
                return Message(op, {"selection": self._priorities[1]}, arrays)  # refused, or for a new core
            if code == _SERVE_IN_PYTHON:
                ask = torch.tensor([count, seed, num_columns], dtype=torch.int64).view(torch.uint8)
                armed = {Op.SAMPLE_WINDOWS: self._windows, Op.SAMPLE_PRIORITIZED: self._priorities}.get(op)
                return Message(op, armed[1] if armed is not None else {}, [ask])
            if code != _CATCH_UP:
                raise wire.socket_error(code)
            if caught_up and not answered:
                return None  # writers keep the view behind: Python answers this one (its pick catches up)
            if not self._catch_up():
                return None  # the request is answered in Python, which says what is wrong
            caught_up = True
        return None

    def arm(self, meta: dict[str, Any], spec: SelectionSpec) -> None:
        """Let the extension answer the next SAMPLE_WINDOWS or SAMPLE_PRIORITIZED of ``spec`` (whose JSON is
        ``meta``), or the next in-place ask of it, which Python just answered (so its selector exists and, for
        windows, its episode markers were checked)."""
        key = json.dumps(meta, separators=(",", ":")).encode()
        if isinstance(spec, WindowSpec):
            self._windows = key, meta, spec
        elif spec.answered_by == "prioritized":
            self._priorities = key, meta, spec

    @property
    def _priority_spec(self) -> SelectionSpec | None:
        return None if self._priorities is None else self._priorities[2]

    def _window_rule(self) -> _WindowRule | None:
        """The armed rule as the extension draws it, its state brought up to the view's index."""
        if self._windows is None:
            return None
        key, _, spec = self._windows
        with self.view.selector(spec) as selector:
            state = selector.draw_state(self.view.shard) if isinstance(selector, WindowSelector) else None
        if state is None:
            return None
        tree, episode_start, episode_length = state
        lo, hi = self.view.shared.seen_positions
        return _C.WindowRule(
            key=key,
            tree=tree,
            episode_start=episode_start,
            episode_length=episode_length,
            window_len=spec.window_len,
            burn_in=spec.burn_in,
            strict_length=spec.strict_length,
            seen_lo=lo,
            seen_hi=hi,
        )

    def _priority_rule(self) -> _PriorityRule | _PriorityWindowRule | None:
        """The armed prioritized rule as the extension draws and updates it: the shared core's tables and lock
        (for windows, the core brought up to the view's store and index first)."""
        if self._priorities is None:
            return None
        key, _, spec = self._priorities
        core, lock = self.view.selectors.shared_core(spec)
        if isinstance(spec, PriorityWindowSpec):
            return self._priority_window_rule(key, spec, core, lock)
        tables = core.native_tables() if isinstance(core, PrioritySelector) else None
        if tables is None:
            return None
        return _C.PriorityRule(
            key=key,
            update_key=rule_meta(spec),
            **tables._asdict(),
            rows_per_step=self.view.shard.addressing.rows_per_step,
            lock=lock,
        )

    def _priority_window_rule(
        self, key: bytes, spec: PriorityWindowSpec, core: object, lock: Any
    ) -> _PriorityWindowRule | None:
        if not isinstance(core, PriorityWindowSelector):
            return None
        with lock:
            core.follow(self.view.shard)
            state = core.draw_state(self.view.shard)
        if state is None:
            return None
        tables, live = state
        lo, hi = self.view.shared.seen_positions
        return _C.PriorityWindowRule(
            key=key,
            update_key=rule_meta(spec),
            **tables._asdict(),
            **live._asdict(),
            **window_keys(spec),
            seen_lo=lo,
            seen_hi=hi,
            lock=lock,
        )

    def answer_in_place(self, ask: Ask) -> Picked | None:
        """``ask``'s uniform rows, or windows or prioritized rows of an armed rule, drawn and gathered into its
        own tensors as the extension answers a socket; None where Python must answer it (``ShardView.pick``;
        then ``arm``)."""
        windows = self._windows[2] if self._windows is not None and ask.samples_windows else None
        priorities = self._priorities[2] if self._priorities is not None and ask.samples_prioritized else None
        if self.view.shared.log.reading or self.view.shared.rates.has_rule:  # a section Python holds, or
            return None  # draws under a rate limiter (counted by ShardView.pick): Python's
        if not (ask.samples_rows or windows == ask.spec or priorities == ask.spec):
            return None
        source = self._mapped()
        if source is None:
            return None
        if ask.samples_rows:
            return self._rows_in_place(ask, source)
        if windows is not None:
            return self._windows_in_place(ask, source, windows)
        return self._prioritized_in_place(ask, source)

    def _rows_in_place(self, ask: Ask, source: _Source) -> Picked | None:
        log = self.view.shared.log
        if time.monotonic() - self._caught_up > CATCH_UP_S or log.records_unseen() > log.num_records // 4:
            self._catch_up()
        assert ask.picks is not None and ask.columns is not None  # (samples_rows)
        picks = ask.picks.starts[ask.first : ask.first + ask.count]
        live = _C.sample_rows_into(*source, ask.count, ask.sample_seed, picks, ask.rows(ask.count))
        return None if live < 0 else ask.landed(ask.count, float(live), {"rows": live})

    def _windows_in_place(self, ask: Ask, source: _Source, windows: WindowSpec) -> Picked | None:
        rule = self._window_rule() if self._view_current() else None
        if rule is None:
            return None
        live, mass, starts, valid_begin, valid_end = _C.sample_windows_into(
            *source,
            rule,
            self.view.shared.log.seen_seq,
            ask.count,
            ask.sample_seed,
            ask.rows(ask.count * windows.window_len),
        )
        if live < 0:
            return None
        return Picked(starts, windows.window_len, valid_begin, valid_end, mass, scalars={"rows": live})

    def _prioritized_in_place(self, ask: Ask, source: _Source) -> Picked | None:
        """Rows: the table follows the store, draws and copies under its lock, as for a socket (no catch-up
        needed). Windows: the view catches up first, as for uniform windows."""
        if isinstance(ask.spec, PriorityWindowSpec):
            return self._priority_windows_in_place(ask, source, ask.spec)
        rule = self._priority_rule()
        if rule is None:
            return None
        assert ask.picks is not None and ask.extra is not None  # (samples_prioritized)
        end = ask.first_pick + ask.count
        live, mass, min_mass = _C.sample_prioritized_into(
            *source,
            rule,
            ask.count,
            ask.sample_seed,
            ask.picks.starts[ask.first_pick : end],
            ask.extra["mass"][ask.first_pick : end],
            ask.extra["generation"][ask.first_pick : end],
            ask.rows(ask.count),
        )
        return None if live < 0 else ask.landed(ask.count, mass, {"rows": live, "min_mass": min_mass})

    def _priority_windows_in_place(self, ask: Ask, source: _Source, spec: PriorityWindowSpec) -> Picked | None:
        rule = self._priority_rule() if self._view_current() else None
        if rule is None:
            return None
        assert ask.picks is not None and ask.extra is not None  # (samples_prioritized)
        first, end = ask.first_pick, ask.first_pick + ask.count
        windows = ask.picks.part(first, end)
        live, mass, min_mass = _C.sample_priority_windows_into(
            *source,
            rule,
            self.view.shared.log.seen_seq,
            ask.count,
            ask.sample_seed,
            [windows.starts, windows.valid_begin, windows.valid_end],
            ask.extra["mass"][first:end],
            ask.extra["generation"][first:end],
            ask.rows(ask.count * spec.window_len),
        )
        return None if live < 0 else ask.landed(ask.count, mass, {"rows": live, "min_mass": min_mass})

    def _view_current(self) -> bool:
        """Whether the view is current, caught up first if the store moved on: windows are placed in its
        episode index."""
        return not self.view.shared.log.records_unseen() or self._catch_up()

    def _catch_up(self) -> bool:
        """Replay what was published since the view last looked; False where that failed (Python says why)."""
        try:
            self.view.catch_up()
        except (StoreClosedError, ReadRevokedError):
            return False
        self._caught_up = time.monotonic()
        return True

    def _mapped(self) -> _Source | None:
        """What the extension reads, for the layout published now; None before any (Python says it is empty)."""
        shared = self.view.shared
        columns = shared.mapped_columns()
        version = shared.mapped_layout_version
        if self._source is None or self._source[3] != version:
            if self.view.shard.table is None or not columns:
                return None
            header, reader = shared.log.native_words()
            self._source = header, reader, list(columns), version
        return self._source

    def close(self) -> None:
        """Drop the views of the control segment (it cannot be unmapped while they live)."""
        self._source = None
