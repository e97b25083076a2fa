"""`eyas loop`: the loop as a service — the watch of the promotion line's served drafter every interval, and a refresh
of the line when the watch says below threshold or stale target, no sooner than a minimum interval after the last."""
