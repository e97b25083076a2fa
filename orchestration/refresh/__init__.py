"""`eyas refresh`: a drafter that keeps up with its traffic — fine-tune on the recent recorded prompts, promote the
candidate only when it is better on held-out recent prompts, keep the previous one for a rollback."""
