"""The in-process chat runtime: a loaded model (``core``) and its sessions (``local``,
``session``), one exchange as one pipeline (``exchange``), the streams that read it (``stream``,
``aio``), stateless calls (``stateless``) and saved sessions (``persistence``)."""
