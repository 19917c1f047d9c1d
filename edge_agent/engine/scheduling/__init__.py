"""Where a request waits for a slot and how its steps are batched.

Owns the admission queue in front of each model (`admission`: two priority classes,
bounded, 503 when full, and the lane of a batch's lines), the worker thread that owns a
model's context, decodes every running sequence in one batch per step and makes a batch's
lines yield to other work (`scheduler`), the step policy's arithmetic
(`steppolicy`) and the cost of a prompt chunk it sizes steps with (`stepcost`), the prompt
cache beyond the sequences (`prompt_cache`, `prompt_disk`), and the three ways of guessing
tokens ahead: prompt lookup (`prompt_lookup`), a draft model (`draftmodel`) and, for the
same prompt again, the answer held after it (`scheduler`).

Never: the model store (`engine.models`); a model reaches it already loaded. A token is
chosen by `constrained.sampler`, text cut by `text.textstream`. Next:
`scheduler.ModelScheduler.submit`.
"""
