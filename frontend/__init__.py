"""The HTTP frontend: aiohttp processes that decode, validate and tokenize requests, hand token ids
to a worker through shared memory, and render the results. Never imports torch."""
