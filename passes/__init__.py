"""Built-in rewrite passes, shipped as ``fxsplit.passes``.

Every module here imports only fxsplit's public API (``fxsplit`` and the modules listed in
``fxsplit.PUBLIC_MODULES``), exactly as a user's own pass would.

May import: the public modules of ``fxsplit.tp``, ``fxsplit.pipeline``, ``fxsplit.schedule`` and
``fxsplit.graph`` (no private names); never the runtime, the API or the top-level package.
"""
