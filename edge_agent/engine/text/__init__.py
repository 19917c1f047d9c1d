"""Text in and out of a model: chat templates and the stream a client reads.

Owns rendering the model's own Jinja chat template in a sandbox (`templates`) and turning
token bytes into text a client can show, whole UTF-8 characters with stop strings cut
(`textstream`).

Never: tokens chosen, requests queued or models loaded. The prompt a request becomes is
`engine.prompt`, which uses these. Next: `templates.ChatTemplate`.
"""
