"""Plan before you load (or rent): exact memory for a model from its config and checkpoint headers, for this
machine or a GPU target, without reading any weight.

    plan = jmoe.plan("path/to/model", target="h100", cache=16)
    plan.fits, plan.reasons, plan.report(), plan.to_json(), plan.programs["decode"].hlo_text, plan.estimate

`jmoe.plan` is both this package and the function `plan`: calling the package calls the function, so
`jmoe.plan(...)` and `from jmoe.plan import Plan` both work. Modules: headers (what the checkpoint holds),
targets (GPU target configs), resources (memory available), budget (bytes needed, the fit check),
programs + workers + compile_worker (ahead-of-time compiles for a target), estimate + hit_rate (tokens/s on the
target), planner (plan, Plan), report.
"""

import sys
import types

from jmoe.plan.planner import Plan, plan, plan_with_options
from jmoe.plan.targets import target_names

__all__ = ["Plan", "plan", "plan_with_options", "target_names"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs) -> Plan:
        return plan(*args, **kwargs)

    __call__.__doc__ = plan.__doc__


sys.modules[__name__].__class__ = _CallablePackage
