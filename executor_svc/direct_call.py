"""Calling a torch.compile'd function without dynamo once it is compiled.

torch.compile runs a function through dynamo's frame hook on every call:
a cache lookup, guards, the compile stance and argument handling, about
0.1-0.2 ms here. A small graph called once a step (the compiled CPU decode
step) or a small kernel called many times a step (the one-row GEMV) pays
that each time. DirectCall is a dynamo backend that compiles with inductor
as torch.compile's default would and keeps the result, so that the caller
can then call it with the argument list dynamo would have built.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class DirectCall:
    """A torch.compile'd function, called without dynamo once compiled.

    Pass `backend` to torch.compile; it compiles with inductor (with
    config_patches) and keeps the first graph it compiles. After the first
    call, bind() works out the argument list dynamo passes that graph: the
    call's own tensors (matched by identity), the sizes of their dynamic
    dims (matched by symbol), and the tensors the function reads from
    elsewhere (weights, buffers, a KV pool), which must stay the same
    objects for as long as it is called. bind() checks the direct call
    against the dynamo call it follows and binds only if they agree bit for
    bit; until bound, the caller calls through dynamo. No guard is checked
    on a direct call: it serves inputs of the first call's dtypes, layouts
    and static sizes only, which the caller ensures.

    Measured on stories260K's compiled decode step (one thread, interleaved):
    0.51-0.52 ms a step called directly against 0.68-0.74 through dynamo.
    """

    def __init__(self, name: str, config_patches: dict | None = None):
        self.name, self.config_patches = name, config_patches
        self._compiled = None  # inductor's function, as dynamo calls it
        self._placeholders: list = []
        self._examples: list = []
        self._template: list = []
        self._inputs_at: list[tuple[int, int]] = []  # (argument position, input index)
        self._sizes_at: list[tuple[int, int, int]] = []  # (argument position, input index, dim)
        # Below the wrappers (see _bind_inductor): inductor's own callable
        # and, for each of its arguments, the position in ours.
        self._inner = None
        self._inner_from: list[int] = []
        # Where inductor's C++ wrapper takes a size, which it would turn
        # into a 0-dim tensor on every call (a few µs apiece): those
        # arguments' positions, filled from a cache of such tensors.
        self._inner_sizes: list[int] = []
        self._size_tensors: dict[int, torch.Tensor] = {}
        self.bound = False

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list):
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches=self.config_patches)
        if self._compiled is None:
            self._compiled = compiled
            self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            self._examples = list(example_inputs)
        return compiled

    def bind(self, inputs: tuple[torch.Tensor, ...], through_dynamo: tuple) -> None:
        """inputs: the first call's (all tensors, positional); through_dynamo:
        what it returned, a tensor or a tuple of them. Inputs whose values
        make a weak check (zeros) make a weak bind."""
        if isinstance(through_dynamo, torch.Tensor):
            through_dynamo = (through_dynamo,)
        if self._compiled is None or len(self._placeholders) != len(self._examples):
            log.info("%s: calls go through dynamo (nothing captured)", self.name)
            return
        # Which of the step's inputs each argument is (None: not one), and
        # where each dynamic size's symbol can be read: (input, dim).
        input_of = [next((i for i, t in enumerate(inputs) if t is example), None) for example in self._examples]
        symbol_at = {}
        for node, at in zip(self._placeholders, input_of):
            fake = node.meta.get("example_value")
            if at is not None and fake is not None:
                for dim, size in enumerate(fake.shape):
                    if isinstance(size, torch.SymInt):
                        symbol_at.setdefault(str(size.node.expr), (at, dim))
        template, inputs_at, sizes_at = [], [], []
        for pos, (node, example, at) in enumerate(zip(self._placeholders, self._examples, input_of)):
            fake = node.meta.get("example_value")
            if at is not None:
                inputs_at.append((pos, at))
            elif isinstance(example, torch.Tensor):
                pass  # a weight, buffer or the pool: the same object on every call
            elif isinstance(fake, torch.SymInt) and str(fake.node.expr) in symbol_at:
                sizes_at.append((pos, *symbol_at[str(fake.node.expr)]))
            else:
                log.info("%s: calls go through dynamo (argument %s is %r)", self.name, node.name,
                         type(example).__name__)
                return
            template.append(example)
        self._template, self._inputs_at, self._sizes_at = template, inputs_at, sizes_at
        try:
            direct = self.call(inputs)
        except Exception:  # an argument list dynamo would not have passed: keep dynamo's
            log.exception("%s: the direct call failed; calls go through dynamo", self.name)
            return
        if not _same(direct, through_dynamo):
            log.warning("%s: the direct call disagrees with dynamo's; calls go through dynamo", self.name)
            return
        self.bound = True
        self._bind_inductor(self._args(inputs), through_dynamo)

    def _bind_inductor(self, args: list, through_dynamo: tuple) -> None:
        """Skips the layers between the compiled function and inductor's
        generated code (AOT autograd's runtime wrappers, the compiled
        graph's bookkeeping: about 25 µs a call on stories260K's decode
        step), where they have nothing to do: an inference graph that
        mutates nothing and returns fresh tensors. It records the argument
        list those layers hand inductor in one call and keeps the direct
        route only if each of its arguments is one of ours (a tensor by
        identity, sizes in order) and the outputs agree bit for bit; else
        calls keep going through the wrappers."""
        from torch._inductor.output_code import CompiledFxGraph

        seen = []
        wrapped = CompiledFxGraph.__call__

        def spy(graph, inner_args):
            seen.append((graph, list(inner_args)))
            return wrapped(graph, inner_args)

        CompiledFxGraph.__call__ = spy
        try:
            outer = tuple(self._compiled(*args))
        except Exception:
            log.exception("%s: a call to record inductor's arguments failed; calls keep the wrappers", self.name)
            return
        finally:
            CompiledFxGraph.__call__ = wrapped
        if len(seen) != 1 or seen[0][0].current_callable is None:
            return
        graph, inner_args = seen[0]
        # Sizes are plain ints: they are matched in order, and only if inductor
        # gets the same ones in the same order as the wrappers did.
        sizes_at = [i for i, a in enumerate(args) if isinstance(a, int)]
        if [a for a in inner_args if isinstance(a, int)] != [args[i] for i in sizes_at]:
            log.info("%s: inductor gets other sizes than ours; calls keep the wrappers", self.name)
            return
        next_size = iter(sizes_at)
        inner_from = []
        for a in inner_args:
            if isinstance(a, torch.Tensor):
                at = next((i for i, b in enumerate(args) if b is a), None)
            elif isinstance(a, int):
                at = next(next_size)
            else:
                at = None
            if at is None:
                log.info("%s: inductor gets an argument of its own (%s); calls keep the wrappers", self.name,
                         type(a).__name__)
                return
            inner_from.append(at)
        try:
            inner = tuple(graph.current_callable([args[i] for i in inner_from]))
        except Exception:
            log.exception("%s: calling inductor's code directly failed; calls keep the wrappers", self.name)
            return
        if not (_same(inner, outer) and _same(inner, through_dynamo)):
            log.warning("%s: inductor's direct outputs disagree; calls keep the wrappers", self.name)
            return
        self._inner, self._inner_from = graph.current_callable, inner_from
        if (self.config_patches or {}).get("cpp_wrapper"):
            self._inner_sizes = [i for i, a in enumerate(inner_args) if isinstance(a, int)]

    @property
    def below_wrappers(self) -> bool:
        """Whether calls go straight to inductor's generated code."""
        return self._inner is not None

    def fixed_tensors(self) -> list[torch.Tensor]:
        """The tensors a bound call reads from elsewhere (weights, buffers),
        the same objects on every call unless retargeted."""
        return [t for t in self._template if isinstance(t, torch.Tensor)]

    def retargeted(self, swap: dict[int, torch.Tensor]) -> list:
        """An argument template for call(template=...) that reads, in place
        of each fixed tensor whose id is in `swap`, the tensor it maps to:
        one compiled graph over another module of the same shapes (a
        decoder layer's graph over every layer like it). The caller checks
        the results: nothing here knows what the graph does with them."""
        return [swap.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in self._template]

    def _args(self, inputs: tuple[torch.Tensor, ...], template: list | None = None) -> list:
        args = list(self._template if template is None else template)
        for pos, at in self._inputs_at:
            args[pos] = inputs[at]
        for pos, at, dim in self._sizes_at:
            args[pos] = inputs[at].shape[dim]
        return args

    def call(self, inputs: tuple[torch.Tensor, ...], template: list | None = None) -> tuple:
        """The compiled function's outputs, as a tuple; only once bound, and
        only for inputs of the bound call's dtypes, layouts and static sizes
        (nothing checks them: the caller does, or calls only such).
        template: from retargeted(), else the bound call's own."""
        args = self._args(inputs, template)
        if self._inner is not None:
            inner_args = [args[i] for i in self._inner_from]
            for i in self._inner_sizes:
                size = inner_args[i]
                t = self._size_tensors.get(size)
                if t is None:
                    t = torch.tensor(size)
                    if len(self._size_tensors) < 4096:
                        self._size_tensors[size] = t
                inner_args[i] = t
            return tuple(self._inner(inner_args))
        return tuple(self._compiled(*args))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        for x, y in zip(a, b))
