"""Compiled graphs kept on disk and called without dynamo: a warm start loads them instead of tracing again.

`torch.compile` keeps Inductor's output in its cache, but every new process still runs dynamo over each graph
(trace, guards, cache lookup) before its first call: SmolLM2's compiled target meets 13 block sizes, and a warm
`warm_up` took 5.6 s of tracing for them (AMD EPYC, one thread, Inductor's cache warm). `Precompiled` compiles
each call shape once with dynamo's ahead-of-time API (`aot_compile`), saves the result (`save_compiled_function`:
the traced bytecode, the guards and Inductor's compiled code) in Specula's cache, and in a later process loads it
(~20 ms a graph; the first load ~1.8 s of Inductor imports): the same warm-up took 2.3 s, and decoded the same tokens.

**Guards.** A loaded graph carries the guards dynamo built for it (tensor shapes, dtypes and strides, constants
read off the modules and objects it was given), less those that cannot be saved (object identities: the file
name's key stands in for them, `structure`). Checking them in Python costs ~75 us a call (2.3 ms a SmolLM2 step of
30 layer calls), so a graph checks them once per set of objects it is called with (layer, head, cache, their
stacked projections: held by weak reference, so a new object at a dead one's address is checked again), and after
that calls go straight to the compiled code, picked by the call's tensor shapes and those objects. A graph whose
guards reject the call is not used: the next saved candidate is tried, then a new one compiled. Where the
ahead-of-time API fails (another backend, a graph it cannot save), the call runs under plain `torch.compile`.

Files live in ``graphs/<key>/`` of `cache_dir` (the key: torch's version, the CPU and its vector ISA, and every
source file of the package, so that a change to the code that was traced compiles again).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from specula.kernels.attention import kernel as attention_kernel
from specula.runtime.float32_layout import cpu_name
from specula.runtime.model_source import cache_dir

PACKAGE = Path(__file__).resolve().parent.parent
# Graph directories kept (the most recently written): each version of the package writes its own, ~1 MB a graph
# (SmolLM2's eagle3 needs 39), and an upgrade or a checkout beside another must not leave them to pile up.
KEPT_DIRECTORIES = 4
# Call signatures remembered before those whose objects are gone are forgotten.
MAX_CALLS = 512
# Saved candidates per call structure: past this a call structure whose guards keep rejecting what was compiled for
# it runs under plain torch.compile (dynamo then recompiles as it would have anyway).
MAX_CANDIDATES = 4


def inductor_cache() -> Path:
    """Where Inductor keeps what it compiled: ``$TORCHINDUCTOR_CACHE_DIR`` where the user set it, else (set now, as
    `specula` does on import) ``inductor/`` in Specula's cache (`cache_dir`), not a temporary directory a reboot
    may clear. The tests' cache directory shares it with the machine's: it is keyed by content."""
    chosen = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    return Path(chosen)


def compiled(function, device: torch.device, guard_modules: bool = False, saveable: bool = False):
    """``function`` under `torch.compile` with static shapes and the options every compiled step here uses.

    ``guard_modules``: keep dynamo's guards on the modules the function is given. A graph that runs one module
    (a head) need not check it again on every call (its weights never change once compiled; ~1 ms a step when
    the whole model was one graph). A graph that every decoder layer shares must: the guards are what tells a
    layer of another structure (e.g. one whose linears stayed float32 where the others are q4_1) to compile its
    own graph rather than run one traced for a different layer (measured, SmolLM2 q4_1: 15.0 ms a one-token step
    guarded, 14.2 without).

    ``saveable``: keep only the guards a saved graph can hold (`aot_compile`): none on object identities, closures
    or globals (`Precompiled` names its files by what those would have checked).
    """
    # On a CPU, Inductor's C++ wrapper calls the step's kernels from C++ rather than from generated Python
    # (SmolLM2 q4_1, one-layer graph: one-token step 15.0 -> 14.2 ms, compile time the same).
    options = {"cpp_wrapper": True} if device.type == "cpu" else {}
    unguarded = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # not in older torch
    if saveable:  # a saved graph checks its guards once per object (`Precompiled`), the modules' included
        options["guard_filter_fn"] = _saveable_guards
    elif unguarded is not None and not guard_modules:
        options["guard_filter_fn"] = unguarded
    if device.type == "cpu":
        attention_kernel()  # decided (and built) before tracing: the graph reads the answer (CPU steps only)
    # One graph per block size and cache size (and, for a head, feature request), for each model structure a
    # process meets (the layer graph is one function for every target): more than dynamo's default of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(function, fullgraph=True, dynamic=False, options=options)


def _saveable_guards(entries) -> list[bool]:
    unsaveable = torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (entry.is_global or entry.guard_type in unsaveable
                 or any(kind in unsaveable for kind in entry.derived_guard_types)) for entry in entries]


def module_structure(module: torch.nn.Module) -> str:
    """A module's structure: its class, its modules', its parameters' and buffers' shapes and dtypes."""
    return ";".join([type(module).__qualname__]
                    + [f"{name}:{type(child).__qualname__}" for name, child in module.named_modules()]
                    + [f"{name}:{tuple(t.shape)}:{t.dtype}"
                       for name, t in [*module.named_parameters(), *module.named_buffers()]])


def graphs_dir() -> Path:
    """``graphs/<key>/`` in Specula's cache: the key changes with torch, the CPU and any source of the package."""
    return cache_dir() / "graphs" / source_key()


@functools.cache
def source_key() -> str:
    """A hash of torch's version, the CPU, its vector ISA and every source file of the package."""
    digest = hashlib.sha256(f"{torch.__version__}|{platform.machine()}|{cpu_name()}|"
                            f"{torch.backends.cpu.get_cpu_capability()}".encode())
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and path.is_file():
            digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def prune_graph_directories(keep: int = KEPT_DIRECTORIES) -> None:
    """Remove all but the ``keep`` most recently written directories of saved graphs (other package versions')."""
    directories = sorted((path for path in graphs_dir().parent.iterdir() if path.is_dir()),
                         key=lambda path: path.stat().st_mtime, reverse=True)
    for path in directories[keep:]:
        shutil.rmtree(path, ignore_errors=True)


def skip_known_vector_isa_probe() -> None:
    """Inductor learns which vector ISAs its C++ compiler can build for by building and loading a probe for each,
    in a subprocess, once per process: 1.2-1.3 s before a new process's first compiled graph runs (loaded or
    not; AMD EPYC). The answer is a fact of the machine, so it is kept beside the graphs once probed, and a later
    process that finds every ISA the CPU offers proved there skips the probe."""
    try:
        from torch._inductor import config, cpu_vec_isa
    except ImportError:
        return
    if config.cpp.vec_isa_ok is not None:  # the user's TORCHINDUCTOR_VEC_ISA_OK
        return
    record = graphs_dir() / "vector-isas.txt"
    try:
        proved = record.read_text()
    except OSError:
        proved = None
    config.cpp.vec_isa_ok = True  # what the CPU offers, unprobed
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    offered = ",".join(map(str, cpu_vec_isa.valid_vec_isa_list()))
    if proved == offered:
        return
    config.cpp.vec_isa_ok = None  # probe
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    if ",".join(map(str, cpu_vec_isa.valid_vec_isa_list())) == offered:
        try:
            graphs_dir().mkdir(parents=True, exist_ok=True)
            record.write_text(offered)
        except OSError:
            pass


def _signature(value) -> object:
    """What picks a graph for one argument of a call, cheaply: a tensor's dtype, device, shape and strides, a
    tuple's members', a scalar's value, an object's identity."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device, value.shape, value.stride()
    if isinstance(value, tuple):
        return tuple(_signature(member) for member in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return id(value)


def _structure(value) -> str:
    """What groups the graphs saved for one argument, across processes: `_signature` with objects described by
    their type (and a module by its `module_structure`); their guards tell candidates of one group apart."""
    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{value.device.type},{tuple(value.shape)},{value.stride()})"
    if isinstance(value, tuple):
        return f"{type(value).__qualname__}({','.join(map(_structure, value))})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, torch.nn.Module):
        return module_structure(value)
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def _objects(args: tuple) -> list:
    """The objects among ``args`` (and inside its tuples) that `_signature` names by identity."""
    found = []
    for value in args:
        if isinstance(value, tuple):
            found += _objects(value)
        elif not (value is None or isinstance(value, (torch.Tensor, bool, int, float, str))):
            found.append(value)
    return found


def _reference(value) -> Callable[[], object]:
    try:
        return weakref.ref(value)
    except TypeError:  # e.g. a builtin: held (such objects are few and small)
        return lambda: value


class Precompiled:
    """``function`` compiled per call shape ahead of time, its graphs saved and reloaded (module docstring).

    Called like ``function`` (positional arguments); ``compiled_graphs`` and ``loaded_graphs`` count what this
    object compiled and what it read from disk. ``guard_modules`` is `compiled`'s, for the calls that fall back to
    plain torch.compile; a saved graph always keeps the modules' guards (it checks them once per object)."""

    def __init__(self, function: Callable, device: torch.device, guard_modules: bool = False):
        self.function, self.device = function, device
        self.dynamo = compiled(function, device, guard_modules)  # where a graph cannot be saved
        self.ahead = compiled(function, device, saveable=True)
        self._calls: dict = {}  # _signature of a call -> (graph, references to the call's objects)
        self._graphs: dict[str, list] = {}  # structure of a call -> its candidate graphs (loaded or compiled)
        self._refused: set[str] = set()  # structures the ahead-of-time API failed on
        self._lock = threading.Lock()
        self.compiled_graphs = self.loaded_graphs = 0
        if device.type == "cpu":
            skip_known_vector_isa_probe()

    def __call__(self, *args):
        signature = tuple(_signature(a) for a in args)
        known = self._calls.get(signature)
        if known is None or any(reference() is None for reference in known[1]):
            with self._lock:
                if len(self._calls) >= MAX_CALLS:  # calls with objects since gone (e.g. each request's caches)
                    self._calls = {key: entry for key, entry in self._calls.items()
                                   if all(reference() is not None for reference in entry[1])}
                known = (self._graph_for(args), [_reference(o) for o in _objects(args)])
                self._calls[signature] = known
        return known[0](*args)

    def _graph_for(self, args: tuple) -> Callable:
        """A graph whose guards accept ``args``: loaded, else compiled now (and saved), else plain torch.compile."""
        structure = "|".join([self.function.__qualname__, self.device.type, *map(_structure, args)])
        name = hashlib.sha256(structure.encode()).hexdigest()[:24]
        candidates = self._graphs.setdefault(name, [])
        if not candidates:
            candidates += self._load(name)
        for graph in candidates:
            if graph.guard_check(*args):
                return graph
        if len(candidates) >= MAX_CANDIDATES or name in self._refused:
            return self.dynamo
        try:
            graph = self.ahead.aot_compile((args, {}))
        except Exception:  # noqa: BLE001 - the ahead-of-time API refused this graph: dynamo compiles it as before
            self._refused.add(name)
            return self.dynamo
        self.compiled_graphs += 1
        graph.disable_guard_check()  # checked here, once per set of objects (`__call__`)
        if not graph.guard_check(*args):  # guards that cannot hold even for the call they were built from
            self._refused.add(name)
            return self.dynamo
        candidates.append(graph)
        self._save(graph, name, len(candidates) - 1)
        return graph

    def _load(self, name: str) -> list:
        graphs = []
        for index in range(MAX_CANDIDATES):
            path = graphs_dir() / f"{name}-{index}.bin"
            try:
                with open(path, "rb") as file:
                    graph = torch.compiler.load_compiled_function(file, f_globals=self.function.__globals__)
            except FileNotFoundError:
                break
            except Exception:  # noqa: BLE001 - a damaged or incompatible file: compiled again, and replaced
                break
            graph.disable_guard_check()
            graphs.append(graph)
            self.loaded_graphs += 1
        return graphs

    def _save(self, graph, name: str, index: int) -> None:
        try:
            if not graphs_dir().is_dir():
                graphs_dir().mkdir(parents=True)
                prune_graph_directories()
            graph.save_compiled_function(str(graphs_dir() / f"{name}-{index}.bin"))  # written whole, then renamed
        except Exception:  # noqa: BLE001 - unwritable cache, or a graph the format cannot hold: kept in memory only
            pass
