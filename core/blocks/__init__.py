"""Building blocks the families compose (DESIGN.md): residual kinds (``residual``), mixers
(``attention``, ``mla``, ``linear_attention``), feed-forwards and routers (``mlp``, ``routers``),
and the ends (``embed``). Each is a declaration (sizes and options; its tensors follow) whose
``build`` loads a callable block; blocks get the pass's context (core.step.Step), never the engine."""
