"""The CI webhook receiver: signed JSON triggers start build_and_deploy flow runs.

Open-source Prefect has no inbound webhooks (Prefect Cloud has), hence this small
ASGI app: HMAC-SHA256 over the raw body (GitHub's ``X-Hub-Signature-256`` header),
a timestamp window against replays, an idempotency key, a body size limit and a
rate limit, then ``run_deployment``.
"""
