"""Text in and out: tokenizers (tokenizer.json and Kimi's tiktoken layout), chat templates run in
jinja's sandbox, and the incremental detokenizer with stop strings that every reply reads
(stream.py)."""
