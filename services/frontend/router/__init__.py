"""Which engine serves a request (issue 15). The core, without I/O: a prefix index of which
worker holds which block (fed by KV events, or approximated from the router's own decisions)
and the cost that picks an engine from the overlaps and the engines' load. Around it: the
KV events subscriber that feeds the index (kv_event_subscriber.py), the sessions kept on
their engines (session_table.py) and the router the request path calls (engine_router.py).

    overlaps = index.overlaps(prompt_block_hashes)
    decision = cost.choose(num_prompt_blocks, engine_to_load, overlaps)
"""

from services.frontend.router.approximate import ApproximateIndex
from services.frontend.router.cost import (
    EngineLoad,
    NoEngineError,
    RouteReason,
    RoutingCost,
    RoutingDecision,
)
from services.frontend.router.prefix_index import ENGINE_MEDIA, PrefixIndex

__all__ = ["ENGINE_MEDIA", "ApproximateIndex", "EngineLoad", "NoEngineError", "PrefixIndex",
           "RouteReason", "RoutingCost", "RoutingDecision"]
