"""The KV router's core, without I/O (issue 15): a prefix index of which worker holds which
block (fed by KV events, or approximated from the router's own decisions) and the cost that
picks an engine from the overlaps and the engines' load. The NATS wiring lives with its user.

    overlaps = index.overlaps(prompt_block_hashes)
    decision = cost.choose(num_prompt_blocks, engine_to_load, overlaps)
"""

from services.common.router.approximate import ApproximateIndex
from services.common.router.cost import (EngineLoad, NoEngineError, RouteReason, RoutingCost,
                                         RoutingDecision)
from services.common.router.prefix_index import ENGINE_MEDIA, PrefixIndex

__all__ = ["ENGINE_MEDIA", "ApproximateIndex", "EngineLoad", "NoEngineError", "PrefixIndex",
           "RouteReason", "RoutingCost", "RoutingDecision"]
