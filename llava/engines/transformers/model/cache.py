"""KV caches that grow in place, so a forward pass does not copy the whole cache.

transformers' stock `DynamicLayer` concatenates its keys and values with every new token: each
decode step and each follow-up prefill copies the session's entire cache. These layers keep
spare room and write new positions in place; they copy only when the room runs out, and then
grow by a chunk, not by half, so an idle session holds little unused memory.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from llava.engines.transformers.model.loading import HOST

CHUNK = 64  # tokens of spare room added when a cache runs out
OFFLOADING = "llava_offloading"  # a cache's attribute: the event its copy to host memory records
_COPY_STREAMS: dict[torch.device, Any] = {}  # per card: the stream offloads copy on


class PreallocatedLayer(DynamicLayer):
    """A cache layer over buffers with spare room; `keys`/`values` are views of the used part."""

    def __init__(
        self,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        length: int = 0,
    ) -> None:
        super().__init__()
        self._keys, self._values, self._length = keys, values, length
        if keys is not None:
            self.lazy_initialization(keys, values)
            self._expose()

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the allocated buffers (the layer must hold some)."""
        if self._keys is None or self._values is None:
            raise RuntimeError("cache layer has no buffers yet")
        return self._keys, self._values

    def _expose(self) -> None:
        keys, values = self._buffers()
        self.keys = keys[:, :, : self._length]
        self.values = values[:, :, : self._length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self._keys is None or self._values is None:
            self.lazy_initialization(key_states, value_states)
            self._keys = _empty_like(key_states, new + CHUNK)
            self._values = _empty_like(value_states, new + CHUNK)
        elif self._length + new > self._keys.shape[2]:
            extra = self._length + new - self._keys.shape[2] + CHUNK
            self._keys = _widen(self._keys, extra)
            self._values = _widen(self._values, extra)
        end = self._length + new
        keys, values = self._buffers()
        keys[:, :, self._length : end] = key_states
        values[:, :, self._length : end] = value_states
        self._length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` positions (transformers' negative convention)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self._length = max(0, self._length + tokens_to_remove)
        if self._keys is not None:
            self._expose()

    def assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the contents, reusing the buffers when they are large enough."""
        length = keys.shape[2]
        if self._keys is None or self._keys.shape[2] < length or self._keys.shape[0] != 1:
            if self._keys is None:
                self.lazy_initialization(keys, values)
            self._keys = _empty_like(keys, length + CHUNK)
            self._values = _empty_like(values, length + CHUNK)
        own_keys, own_values = self._buffers()
        own_keys[:, :, :length] = keys
        own_values[:, :, :length] = values
        self._length = length
        self._expose()

    def adopt(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Switch to copies of the buffers (with their spare room) on `device` (cannot fail)."""
        for name, tensor in tensors.items():
            setattr(self, name, tensor)
        self.device = device
        if self._keys is not None and self._values is not None:
            self._expose()

    def buffers(self) -> list[torch.Tensor]:
        """Return the allocated tensors (what the layer really holds in memory)."""
        return [t for t in (self._keys, self._values) if t is not None]


def new_cache(num_layers: int) -> DynamicCache:
    """Return an empty cache whose layers grow in place."""
    cache = DynamicCache()
    cache.layers = [PreallocatedLayer() for _ in range(num_layers)]
    return cache


def batch_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> DynamicCache:
    """Wrap preallocated per-layer buffers (already holding `length` positions) as a cache."""
    cache = DynamicCache()
    cache.layers = [PreallocatedLayer(k, v, length) for k, v in layers]
    return cache


def assign(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Set a layer's contents, whatever kind of layer it is."""
    if isinstance(layer, PreallocatedLayer):
        layer.assign(keys, values)
    else:
        layer.keys, layer.values = keys, values


def crop_to(cache: DynamicCache, length: int) -> None:
    """Cut every layer to its first `length` positions.

    A forward that failed part-way may have grown some layers and not others: each layer is
    cut on its own, never by layer 0's length.
    """
    for layer in cache.layers:
        current = layer.get_seq_length()
        if current > length:
            layer.crop(length - current)


def move_cache(cache: DynamicCache, device: torch.device) -> None:
    """Move every layer of a cache to `device`, all or nothing: every layer is copied before
    any is switched, so a copy that fails (out of memory) leaves the whole cache where it was,
    never split across devices. From a GPU to host memory the copy goes to pinned memory on a
    side stream (`_offload`): the step goes on while it finishes."""
    settle(cache)
    source = _device_of(cache)
    if device.type == "cpu" and source is not None and source.type == "cuda":
        _offload(cache, source)
        return
    copies = [
        {name: _copy(t, device) for name, t in _held(layer).items()} for layer in cache.layers
    ]
    for layer, moved in zip(cache.layers, copies, strict=True):
        _adopt(layer, moved, device)


def settle(cache: DynamicCache | None) -> None:
    """Wait for a copy to host memory still running for this cache, before its host buffers are
    read or moved (`_offload` leaves the event on the cache)."""
    copied = getattr(cache, OFFLOADING, None)
    if copied is not None:
        copied.synchronize()
        setattr(cache, OFFLOADING, None)


def _offload(cache: DynamicCache, source: torch.device) -> None:
    """Copy a cache from a GPU to pinned host memory on the card's copy stream, without waiting.

    Every host buffer is allocated first (a host out of memory leaves the cache on the card).
    The copies wait for the work already queued on the card, and each card buffer is recorded
    on the copy stream, so the allocator reuses its memory only once its copy is done; the
    cache's readers wait for the copy (`settle`)."""
    held = [_held(layer) for layer in cache.layers]
    hosts = [
        {name: torch.empty_like(t, device="cpu", pin_memory=True) for name, t in tensors.items()}
        for tensors in held
    ]
    stream = _COPY_STREAMS.setdefault(source, torch.cuda.Stream(source))
    stream.wait_stream(torch.cuda.current_stream(source))
    with torch.cuda.stream(stream):
        for tensors, host in zip(held, hosts, strict=True):
            for name, tensor in tensors.items():
                host[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)
    copied = torch.cuda.Event()
    copied.record(stream)
    for layer, host in zip(cache.layers, hosts, strict=True):
        _adopt(layer, host, HOST)
    setattr(cache, OFFLOADING, copied)


def _held(layer: Any) -> dict[str, torch.Tensor]:
    """The tensors a layer holds, by the attribute they live in."""
    names = ("_keys", "_values") if isinstance(layer, PreallocatedLayer) else ("keys", "values")
    return {n: t for n in names if (t := getattr(layer, n, None)) is not None}


def _adopt(layer: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Switch a layer to tensors copied to `device` (cannot fail)."""
    if isinstance(layer, PreallocatedLayer):
        layer.adopt(tensors, device)
        return
    for name, tensor in tensors.items():
        setattr(layer, name, tensor)
    layer.device = device


def _device_of(cache: DynamicCache) -> torch.device | None:
    """The device a cache's tensors are on (None: it holds none yet)."""
    for layer in cache.layers:
        for tensor in _held(layer).values():
            return tensor.device
    return None


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device)


def cache_tensors(cache: DynamicCache | None) -> list[torch.Tensor]:
    """List the tensors a cache holds in memory (buffers, spare room included)."""
    if cache is None:
        return []
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            out.extend(layer.buffers())
        else:
            out.extend(
                t
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if t is not None and t.numel()
            )
    return out


def _empty_like(tensor: torch.Tensor, length: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[2] = length
    return tensor.new_zeros(shape)


def _widen(tensor: torch.Tensor, extra: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[2] = extra
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=2)
