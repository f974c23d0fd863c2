"""``envhub eval``: any chat model against any env, N tasks x K samples, transcripts and pass@k on disk.

One episode loop (:mod:`envhub.eval.episode`) serves every model: an OpenAI-compatible endpoint
(:class:`envhub.chat.ChatCompletionsClient`) or a local model an installed distribution registers in
the ``envhub.chat_models`` entry-point group (the trainer's ``local``: ``tiny``, an HF model path).
:mod:`envhub.eval.runner` plays the episodes, appends one line per episode to ``results.jsonl`` and
writes ``summary.json`` (:mod:`envhub.eval.summary`); ``docs/eval.md`` describes both files.
"""

#: the system prompt of an episode whose env sends none (``--system-prompt`` replaces it)
DEFAULT_SYSTEM_PROMPT = ("You are an agent in an environment. Use the tools it offers when it offers them; "
                         "otherwise answer in plain text.")
