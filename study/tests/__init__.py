"""The study's tests: its runner, summarizers and scripts on synthetic records whose answer is known."""
