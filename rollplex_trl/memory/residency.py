"""The residency manager: at every phase boundary, put each registered object where its lifetime class says.

Drive it from the trainer: ``MemoryPhaseCallback`` (``rollplex_trl/callbacks/memory.py``) marks the boundaries
that transformers' Trainer announces (step begin, before/after the optimizer step, step end); the generation and
scoring code marks the rest with ``with manager.phase("rollout"): ...``, since no callback fires around them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rollplex_trl.memory.lifetime import Phase, Placement, as_phase
from rollplex_trl.memory.registry import MemoryObject, MemoryRegistry

if TYPE_CHECKING:
    from rollplex_trl.memory.ledger import MemoryLedger


class ResidencyManager:
    def __init__(self, registry: MemoryRegistry, ledger: MemoryLedger | None = None) -> None:
        self.registry = registry
        self.ledger = ledger
        self.current: Phase | None = None
        self._lock = threading.RLock()  # a prefix job may hold an object from another thread (`using`)
        if ledger is not None and ledger.manager is None:
            ledger.manager = self  # lets a component find the manager that drives a ledger it was handed

    def plan(self, phase: Phase | str) -> dict[str, Placement]:
        """Where every registered object should be during ``phase``."""
        return {obj.name: obj.planned_placement(phase) for obj in self.registry}

    def placements(self) -> dict[str, Placement]:
        """Where every registered object is now."""
        return {obj.name: obj.placement for obj in self.registry}

    def enter(self, phase: Phase | str) -> None:
        """Close the current phase and move every object to its placement for ``phase``."""
        phase = as_phase(phase)
        if self.ledger is not None and self.current is not None:
            self.ledger.end_phase()
        with self._lock:
            self._apply(phase, list(self.registry))
            self.current = phase
        if self.ledger is not None:
            self.ledger.begin_phase(phase)

    @contextmanager
    def phase(self, phase: Phase | str) -> Iterator[None]:
        """``with manager.phase("rollout"): generate()`` enters the phase and, on exit, returns to the previous one."""
        previous = self.current
        self.enter(phase)
        try:
            yield
        finally:
            if previous is not None:
                self.enter(previous)

    @contextmanager
    def using(self, name: str) -> Iterator[MemoryObject]:
        """Hold one object on the device for a use that no phase boundary announces (the reference model for its
        prefix job inside the rollout's decode window, maybe on a worker thread): loaded now if it is not, kept
        there across any boundary meanwhile, and placed for the then-current phase once the last holder leaves."""
        obj = self.registry[name]
        with self._lock:
            obj.in_use += 1
            try:
                if obj.placement is not Placement.DEVICE:
                    _move(obj, Placement.DEVICE)
            except BaseException:
                obj.in_use -= 1
                raise
        if self.ledger is not None:
            self.ledger.sample()
        try:
            yield obj
        finally:
            with self._lock:
                obj.in_use -= 1
                if obj.in_use == 0:
                    if self.current is not None:
                        self._apply(self.current, [obj])
                    else:
                        dest = obj.planned_placement(Phase.IDLE)
                        if obj.placement is not dest:
                            _move(obj, dest)

    def settle(self, name: str | None = None) -> None:
        """Apply the current phase's placement to one object (just registered) or to all of them."""
        if self.current is None:
            return
        objects = [self.registry[name]] if name is not None else list(self.registry)
        with self._lock:
            self._apply(self.current, objects)
        if self.ledger is not None:
            self.ledger.sample()

    def _apply(self, phase: Phase, objects: list[MemoryObject]) -> None:
        # an object in use stays where its holder needs it (on the device) until released
        moves = [(obj, obj.planned_placement(phase)) for obj in objects if obj.in_use == 0]
        # Releases first, loads last: the transition itself then never holds both the outgoing and the incoming
        # objects on the device, so the phase boundary does not set a new peak.
        moves.sort(key=lambda move: move[1] is Placement.DEVICE)
        for obj, dest in moves:
            if obj.placement is not dest:
                _move(obj, dest)
            obj.history.append((phase, obj.placement))


def _move(obj: MemoryObject, dest: Placement) -> None:
    try:
        _apply_move(obj, dest)
    except Exception as exc:
        raise RuntimeError(f"moving memory object {obj.name!r} ({obj.lifetime.value}) from {obj.placement.value} "
                           f"to {dest.value} failed: {exc}") from exc


def _apply_move(obj: MemoryObject, dest: Placement) -> None:
    if dest is Placement.DEVICE:
        obj.target.to_device()
        obj.placement = Placement.DEVICE
    elif dest is Placement.HOST:
        # A freed object has no bytes to park; it stays freed until it is needed (or regenerated) on the device.
        if obj.placement is Placement.DEVICE:
            obj.target.to_host()
            obj.placement = Placement.HOST
    else:
        obj.target.free()
        obj.placement = Placement.FREED


def wrap_in_phase(obj: Any, method: str, manager: ResidencyManager, phase: Phase | str) -> Callable[[], None]:
    """Make ``obj.method(...)`` run inside ``manager.phase(phase)``; returns a function that undoes the wrap.

    The hook around generation without editing the trainer: ``wrap_in_phase(trainer, "_generate", manager,
    "rollout")`` (TRL's GRPOTrainer._generate runs the rollout; no Trainer callback fires around it).
    """
    original = getattr(obj, method)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with manager.phase(phase):
            return original(*args, **kwargs)

    setattr(obj, method, wrapped)

    def undo() -> None:
        # drop the instance attribute so the class's method shows through again (or restore a plain attribute)
        if obj.__dict__.get(method) is wrapped:
            del obj.__dict__[method]
        if getattr(obj, method) is not original:
            setattr(obj, method, original)

    return undo
