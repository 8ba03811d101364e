"""Sentences the Prober is measured on: the ``prober`` experiment's two calls (FIRST computes the
directions, SECOND reuses them) and the tests of the Prober and of ``normfast serve``, which probe the
same texts (tests/engine/test_prober_minilm.py checks at small sizes what the experiment measures at
the demo's; tests/engine/test_prober.py and tests/apps/test_serve.py take FIRST's first eight as their
pair source)."""

FIRST = [
    "the river rose after the storm",
    "a quantum of solace",
    "music for the blue hour",
    "prices fell in the morning",
    "she sang an old song",
    "the committee voted twice",
    "green apples and red stones",
    "a long walk by the sea",
    "the old man and the boat",
    "rain fell on the town",
]
SECOND = [
    "democracy is a fragile idea",
    "the cat slept all day long",
    "bread was warm in the oven",
    "stars burn for billions of years",
    "the market opened late on monday",
    "children played in the park",
    "a letter arrived from paris",
    "the engine failed twice",
    "we planted trees along the road",
    "the violin sounded sad",
]
