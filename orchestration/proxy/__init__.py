"""`eyas proxy`: an OpenAI-compatible pass-through in front of a served endpoint that records a bounded, redacted
sample of the chat requests it forwards (and, where allowed, the answers) into the store, one object per time
window, as messages-JSONL that the generator reads as prompts (DESIGN.md "Over time")."""
