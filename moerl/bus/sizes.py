"""How large a GRPO group's bus entry grows, estimated from the config before a run starts, so a
run whose groups the producer would refuse (over MAX_ENTRY_BYTES: dead-lettered, every one)
fails its preflight instead of generating for ever without training.

Per response token as JSON: its id, its logprob, its text; with routes (R3,
`rollout.return_routed_experts`), MoE layers x top-k route ids of 1 or 2 bytes as base64 for
every token. Tokens per sample: `rollout.max_total_tokens` when set, else the longest
`max_new_tokens` (of the schedule too) times `task.max_turns` for a multi-turn task.

Limitations: a lower bound without max_total_tokens (the prompt's own tokens and routes are
not counted: its length is the dataset's), and JSON widths are typical, not worst-case.
"""

from __future__ import annotations

from moerl.bus.scripts import MAX_ENTRY_BYTES
from moerl.config import RunConfig
from moerl.errors import ConfigError

# a token id (up to 6 digits and a comma), a logprob (a float's repr and a comma), its text
TOKEN_JSON_BYTES = 7 + 21 + 4
SAMPLE_OVERHEAD_BYTES = 1024  # the sample's other fields and the prompt's text


def sample_tokens(cfg: RunConfig) -> int:
    """Tokens of one sample the estimate counts (the module docstring)."""
    r = cfg.rollout
    longest = max([r.max_new_tokens, *(s.max_new_tokens for s in r.max_new_tokens_schedule)])
    turns = cfg.task.max_turns if (cfg.task.environment or cfg.task.environments) else 1
    return r.max_total_tokens or longest * turns


def group_bytes(cfg: RunConfig, route_bytes_per_token: int) -> int:
    """A group's estimated entry: samples_per_prompt samples of `sample_tokens` tokens each;
    `route_bytes_per_token`: MoE layers x top-k x id bytes (0: no routes returned)."""
    per_token = TOKEN_JSON_BYTES + -(-route_bytes_per_token * 4 // 3)  # base64
    per_sample = sample_tokens(cfg) * per_token + SAMPLE_OVERHEAD_BYTES
    return cfg.rollout.samples_per_prompt * per_sample


def check_group_size(cfg: RunConfig, route_bytes_per_token: int, routes_why: str = "") -> None:
    """Refuse (ConfigError, exit 2) a config whose groups would exceed the bus's entry cap,
    naming the keys that size them. `routes_why`: the routes' shape in words."""
    est = group_bytes(cfg, route_bytes_per_token)
    if est <= MAX_ENTRY_BYTES:
        return
    r = cfg.rollout
    tokens = (
        f"rollout.max_total_tokens {r.max_total_tokens}"
        if r.max_total_tokens
        else f"rollout.max_new_tokens {sample_tokens(cfg)} (the longest, x task.max_turns)"
    )
    routes = (
        f" + {route_bytes_per_token * 4 // 3} B of routes ({routes_why})"
        if route_bytes_per_token
        else ""
    )
    raise ConfigError(
        f"a GRPO group would take about {est / 2**20:,.0f} MiB on the bus, over its entry cap of "
        f"{MAX_ENTRY_BYTES >> 20} MiB, and every group would be refused: rollout.samples_per_prompt "
        f"{r.samples_per_prompt} x {tokens} tokens x ({TOKEN_JSON_BYTES} B{routes}); lower those, "
        "or set trainer.moe.router_replay disabled and rollout.return_routed_experts false"
    )
