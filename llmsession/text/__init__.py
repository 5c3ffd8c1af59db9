"""Chat text, pure: messages, chat templates (built-in, Jinja, Gemma 4), images as pixels,
replies spliced as their tokens, stop strings, incremental detokenizing, callers' JSON schemas.
Nothing here touches the native layer."""
