"""The text every built-in tokenizer is trained on: a few hundred short English scene descriptions,
generated in code (no download, the same in every process)."""

from __future__ import annotations


def corpus() -> list[str]:
    """A few hundred short English scene descriptions, generated in code."""
    subjects = ["fox", "cat", "dog", "horse", "bird", "robot", "dragon", "child", "woman", "man",
                "car", "train", "ship", "tree", "river", "city", "astronaut", "panda", "whale", "owl"]
    adjectives = ["small", "large", "old", "young", "bright", "dark", "red", "blue", "golden",
                  "silver", "happy", "lonely", "curious", "sleepy", "giant", "tiny"]
    actions = ["runs", "walks", "flies", "swims", "sleeps", "dances", "glows", "waits", "jumps",
               "sings", "drifts", "climbs", "turns slowly", "looks around", "moves forward"]
    places = ["in the forest", "on the beach", "under the stars", "in the rain", "through the snow",
              "across the desert", "near a lake", "in a busy street", "on a mountain",
              "inside a kitchen", "over the ocean", "in a quiet garden"]
    times = ["at dawn", "at night", "at sunset", "in the morning", "during a storm", "in winter",
             "in summer", ""]
    styles = ["", "cinematic lighting", "slow motion", "aerial view", "close up shot",
              "watercolor style", "high detail", "soft focus"]
    sentences = []
    # Strided indices give varied combinations without the full product.
    for i in range(480):
        words = [
            "A" if i % 3 == 0 else "The" if i % 3 == 1 else "a",
            adjectives[(i * 7) % len(adjectives)],
            subjects[i % len(subjects)],
            actions[(i * 5) % len(actions)],
            places[(i * 11) % len(places)],
            times[(i * 3) % len(times)],
        ]
        sentence = " ".join(w for w in words if w)
        style = styles[(i * 13) % len(styles)]
        sentences.append(f"{sentence}, {style}." if style else f"{sentence}.")
    return sentences
