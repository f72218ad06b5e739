"""DeepSeek V4's tensor names as the Hub release writes them -> as transformers writes them.

The release uses DeepSeek's own names (``embed.weight``, ``layers.L.attn.wq_a.weight``,
``layers.L.ffn.experts.E.w1.weight`` ...). transformers 5.25's ``save_pretrained`` of a
``DeepseekV4ForCausalLM`` writes nearly the same names: it reverses its own conversion mapping
(conversion_mapping.py, "deepseek_v4"), so a transformers-layout checkpoint also says ``attn`` /
``ffn`` / ``w1`` / ``wq_a``, per expert, but under ``model.`` and with four leftovers of the
in-memory names. RENAMES turns the release's names into exactly those saved names (checked
against tests/oracle/fixtures/dsv4-*: tests/test_oracle_dsv4.py), so one family layout reads
both:

* ``embed.weight`` -> ``model.embed_tokens.weight``; ``norm.weight`` -> ``model.norm.weight``;
  ``hc_head_{fn,base,scale}`` -> ``model.hc_head.hc_{fn,base,scale}``; ``head.weight`` stays.
* ``layers.L.attn.kv_norm.weight`` -> ``model.layers.L.attn.norm.weight`` (transformers' reverse
  of its ``.norm.`` -> ``.kv_norm.`` renaming also renames the attention's own kv_norm).
* every other ``layers.*`` name gains ``model.``; a ``.scale`` companion follows its weight.

The patterns are anchored and exclusive: applying the first that matches, or all of them in
order, gives the same name. SET_ASIDE matches what the converter leaves out: the MTP blocks.

In memory transformers holds the routed experts fused: ``mlp.experts.gate_up_proj`` [E, 2I, H]
is, for expert e, w1 (gate, rows 0..I-1) over w3 (up, rows I..2I-1), and ``mlp.experts.down_proj``
[E, H, I] stacks w2; ``save_pretrained`` splits them back to ``ffn.experts.E.w{1,2,3}.weight``.
"""

RENAMES: list[tuple[str, str]] = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.attn\.kv_norm\.", r"model.layers.\1.attn.norm."),
    (r"^layers\.", "model.layers."),
]

SET_ASIDE: list[str] = [r"^mtp\."]
