"""kvtier under vLLM: a KV connector on vLLM's v1 API (``kvtier.vllm.connector``).

vLLM does the compute; kvtier's tiers (host, disk, the shared Redis tier) keep the KV, with
kvtier's chunk keys, links, write-behind and checksums. The modules beside the connector
import no vLLM: ``settings`` (the extra config onto kvtier's config), ``paged`` (vLLM's
blocks to and from chunks), ``scheduler_side`` and ``worker_side`` (the two halves'
logic), ``metadata`` (what passes between them), ``identity`` and ``managers``. Only
``connector`` imports vLLM (``pip install kvtier[vllm]``, or vLLM's own environment).
"""
