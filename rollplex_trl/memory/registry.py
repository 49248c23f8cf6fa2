"""The registry: every large object, its lifetime class and its window of phases."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from rollplex_trl.memory.lifetime import (
    LifetimeClass,
    Phase,
    Placement,
    as_phase,
    outside_window_placement,
    window,
)
from rollplex_trl.memory.storage import Movable, TensorGroup
from rollplex_trl.torch_compat import tensor_storage_key


@dataclass
class MemoryObject:
    """One registered object. ``target`` does the moving; the record says where it should be in each phase.

    ``host_phases`` are phases *inside* the window in which the object still waits on the host: the actor prefix's
    saved activations, produced during the decode window and needed only by the backward, are the example.
    """

    name: str
    lifetime: LifetimeClass
    first_use: Phase
    last_use: Phase
    target: Movable
    host_phases: frozenset[Phase] = frozenset()
    can_regenerate: bool = False
    placement: Placement = Placement.DEVICE
    history: list[tuple[Phase, Placement]] = field(default_factory=list)
    in_use: int = 0  # holders inside ``ResidencyManager.using(name)``: while > 0 no phase boundary moves it

    @property
    def window(self) -> tuple[Phase, ...]:
        return window(self.first_use, self.last_use)

    def planned_placement(self, phase: Phase | str) -> Placement:
        phase = as_phase(phase)
        if phase in self.window:
            return Placement.HOST if phase in self.host_phases else Placement.DEVICE
        return outside_window_placement(self.lifetime, self.can_regenerate)

    def nbytes(self) -> int:
        return self.target.nbytes()


class MemoryRegistry:
    """Name -> ``MemoryObject``. Registering a name again replaces it (per-step objects such as prefix state)."""

    def __init__(self, host_device: torch.device | str = "cpu") -> None:
        self.host_device = torch.device(host_device)
        self._objects: dict[str, MemoryObject] = {}

    def register(
        self,
        name: str,
        target: Movable,
        lifetime: LifetimeClass | str,
        first_use: Phase | str,
        last_use: Phase | str,
        *,
        host_phases: Iterable[Phase | str] = (),
        can_regenerate: bool = False,
        placement: Placement = Placement.DEVICE,
    ) -> MemoryObject:
        lifetime = LifetimeClass(lifetime)
        first, last = as_phase(first_use), as_phase(last_use)
        hosts = frozenset(as_phase(p) for p in host_phases)
        if Phase.IDLE in (first, last):
            raise ValueError(f"{name}: 'idle' cannot start or end a window; use the phase of the first/last use")
        outside = hosts - set(window(first, last))
        if outside:
            raise ValueError(f"{name}: host_phases {sorted(p.value for p in outside)} lie outside its window "
                             f"[{first.value}, {last.value}]")
        obj = MemoryObject(name, lifetime, first, last, target, hosts, can_regenerate, placement)
        self._objects[name] = obj
        return obj

    def register_tensors(
        self,
        name: str,
        tensors: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
        lifetime: LifetimeClass | str,
        first_use: Phase | str,
        last_use: Phase | str,
        *,
        host_phases: Iterable[Phase | str] = (),
        regenerate: Callable[[], None] | None = None,
    ) -> MemoryObject:
        """Register tensors (or a callable returning this step's tensors), moved through their storages."""
        lifetime = LifetimeClass(lifetime)
        if not callable(tensors):
            self._check_unshared(name, tensors)
        group = TensorGroup(tensors, host_device=self.host_device, regenerate=regenerate,
                            keep_host_copy=lifetime in (LifetimeClass.PERMANENT, LifetimeClass.REGENERABLE))
        obj = self.register(name, group, lifetime, first_use, last_use, host_phases=host_phases,
                            can_regenerate=regenerate is not None)
        return obj

    def _check_unshared(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        # Two objects over one storage would move it twice (and free it under the other's feet).
        mine = {tensor_storage_key(t) for t in tensors}
        for obj in self:
            if obj.name == name or not isinstance(obj.target, TensorGroup) or callable(obj.target._tensors):
                continue
            if mine & {tensor_storage_key(t) for t in obj.target.tensors()}:
                raise ValueError(f"{name}: shares a tensor storage with the registered object {obj.name!r}; a "
                                 "storage can belong to one object only")

    def __getitem__(self, name: str) -> MemoryObject:
        try:
            return self._objects[name]
        except KeyError:
            raise KeyError(f"no memory object named {name!r}; registered: {sorted(self._objects)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._objects

    def __iter__(self) -> Iterator[MemoryObject]:
        return iter(list(self._objects.values()))

    def __len__(self) -> int:
        return len(self._objects)

    def bytes_by_class(self, placement: Placement = Placement.DEVICE) -> dict[LifetimeClass, int]:
        """Bytes of registered objects currently at ``placement``, per lifetime class (every class present)."""
        out = dict.fromkeys(LifetimeClass, 0)
        for obj in self:
            if obj.placement is placement:
                out[obj.lifetime] += obj.nbytes()
        return out
