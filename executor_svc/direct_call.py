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
        if len(direct) != len(through_dynamo) or not all(
                torch.equal(a, b) for a, b in zip(direct, through_dynamo)):
            log.warning("%s: the direct call disagrees with dynamo's; calls go through dynamo", self.name)
            return
        self.bound = True

    def call(self, inputs: tuple[torch.Tensor, ...]) -> tuple:
        """The compiled function's outputs, as a tuple; only once bound, and
        only for inputs of the bound call's dtypes, layouts and static sizes
        (nothing checks them: the caller does, or calls only such)."""
        args = list(self._template)
        for pos, at in self._inputs_at:
            args[pos] = inputs[at]
        for pos, at, dim in self._sizes_at:
            args[pos] = inputs[at].shape[dim]
        return tuple(self._compiled(*args))
