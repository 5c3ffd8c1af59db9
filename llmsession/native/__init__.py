"""The native layer, the only code that calls llama.cpp and libmtmd: the library and a loaded
model (``llama``), contexts and decoding (``context``), the projector (``projector``), sampler
chains (``sampler``) and llguidance's masks on them (``constraints``), cancel flags (``cancel``),
RPC endpoints (``rpc``) and the post-build check (``smoke``)."""
