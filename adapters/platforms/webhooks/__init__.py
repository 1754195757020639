"""Platform webhooks as plain functions, per platform: `check_headers` (before the body is read),
`parse_webhook` (the signature, then the payload: the turns, an `Answer` that needs none, or a `Refusal`)
and `answer` (the reply once the turns are enqueued). No server and no SDK at import."""

from adapters.platforms.webhooks.base import MAX_CLOCK_SKEW_S, Answer, Inbound, Refusal

__all__ = ["MAX_CLOCK_SKEW_S", "Answer", "Inbound", "Refusal"]
