"""A griffe extension for the API reference: the outer optimizers' constructors are written as
`__init__(self, params, sgd, **own)` and given torch.optim.SGD's signature at run time by
`isoloco_kernels.outer.sgd_state.sgd_shaped`; static analysis cannot see that, so this shows the
signature Python reports (`inspect.signature`) for every `__init__` decorated with it."""

from __future__ import annotations

import importlib
import inspect

import griffe

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


class SGDShapedSignature(griffe.Extension):
    def on_function(self, *, func: griffe.Function, **kwargs) -> None:
        if func.name != "__init__" or not any("sgd_shaped" in str(d.value) for d in func.decorators):
            return
        cls = func.parent
        obj = getattr(importlib.import_module(cls.module.path), cls.name)
        params = [
            griffe.Parameter(
                p.name,
                kind=_KINDS[p.kind],
                default=None if p.default is inspect.Parameter.empty else repr(p.default),
                annotation=None if p.annotation is inspect.Parameter.empty else str(p.annotation),
            )
            for p in inspect.signature(obj.__init__).parameters.values()
        ]
        func.parameters = griffe.Parameters(*params)
