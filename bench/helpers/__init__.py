"""Modules benchmarks import, with no command line of their own (entry points live at bench/'s top level):
`common` (what every benchmark shares: smoke runs, result files, machine description, random checkpoints),
`plan_peers` (published numbers of other engines, for `bench.plan`), and the Markdown writers of
`bench.replay`'s reports over `jmoe.traces`' numbers: `replay_report` (replay.md, replay_tuning.md),
`prefetch_report` (replay_prefetch.md), `tiers_report` (replay_tiers.md)."""
