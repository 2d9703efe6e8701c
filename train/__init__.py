"""Training the built-in model: a small DeepSeek-V4 (with its MTP layer) on the Python documentation.

corpus.py   fetch Debian's python3.11-doc package and turn its HTML into text pages and chat pairs
bpe.py      train the byte-level BPE tokenizer (the server's special tokens and chat template)
geometry.py the built-in and the tiny (test) model configurations
v4.py       transformers' DeepseekV4ForCausalLM plus a differentiable MTP layer, and their losses
export.py   their weights → ringserve's upstream checkpoint layout
evaluate.py held-out loss and bits per character, by transformers and by ringserve's engine
recipe.py   the whole recipe (`ringserve train-builtin`, `scripts/train_builtin.py`)
"""
