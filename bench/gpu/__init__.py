"""The helpers of `python -m bench.gpu_check` (and `bench.plan_calibration`, which replans its models): `models`
(the random checkpoints it builds), `numerics` (kernels, families and offload against references), `speed`
(bandwidth, decode speed, memory), `profile` (a decode step's device / host split, a profiler trace's summary) and
`results` (checks, the time budget, the report). No command line here: entry points live at bench/'s top level."""
