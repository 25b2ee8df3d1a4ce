"""`tds.pipe.schedule`: TDS's schedules as data (`instructions.py`: `train_schedule`, `eval_schedule`, `Op`,
`Instruction`, `simulate`, ...) and DeepSpeed 0.19's schedule and instruction classes as views of them
(`ds_schedule.py`: `TrainSchedule`, `InferenceSchedule`, ...), in one namespace, where code written for
DeepSpeed looks for them. Library code imports the two modules themselves.
"""
from .ds_schedule import *  # noqa: F401,F403
from .ds_schedule import __all__ as _ds_names
from .instructions import *  # noqa: F401,F403
from .instructions import __all__ as _tds_names

__all__ = _tds_names + _ds_names
