"""Recipe for the default model in checkpoints/default: corpus, tokenizer, training, export, evaluation.

Run from the repository root: `python -m checkpoints.recipe.train --work /tmp/jmoe-default`, then
`python -m checkpoints.recipe.evaluate`. See checkpoints/README.md.
"""
