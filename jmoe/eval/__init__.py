"""Batched evaluation: perplexity, throughput and routing statistics of a model on a token stream
(`jmoe.eval.evaluate`, `jmoe.eval.evaluate_file`; command line: `python -m jmoe.eval`)."""

from jmoe.eval.metrics import EvalResult, LayerRouting, evaluate, evaluate_file

__all__ = ["EvalResult", "LayerRouting", "evaluate", "evaluate_file"]
