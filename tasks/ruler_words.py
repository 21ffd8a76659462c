"""The vocabulary of the RULER-style tasks (`tasks.ruler`): common English words, written for kvscope.

Everything the generator puts into a haystack, a needle key or a word list comes from these tuples and a seeded
random generator, so the tasks need no text from outside the project and read the same on every machine. All words
are lowercase ASCII letters only (no digits: the needles' values are the only numbers in a NIAH context).
"""

from __future__ import annotations

ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "bright", "brisk", "broad", "calm", "careful", "cheerful",
    "clever", "cold", "cozy", "crisp", "curious", "damp", "dark", "deep", "distant", "dusty", "eager", "early",
    "empty", "faint", "fancy", "fierce", "flat", "fresh", "friendly", "gentle", "giant", "glad", "golden", "grand",
    "gray", "green", "happy", "heavy", "hidden", "hollow", "honest", "humble", "icy", "idle", "jolly", "keen",
    "kind", "large", "late", "lazy", "little", "lively", "lonely", "loud", "lucky", "mellow", "merry", "mighty",
    "misty", "modest", "narrow", "neat", "nervous", "noble", "odd", "old", "orange", "pale", "patient", "plain",
    "polite", "proud", "purple", "quick", "quiet", "rapid", "rare", "red", "rich", "rough", "round", "royal",
    "rusty", "sad", "salty", "scarlet", "secret", "sharp", "shiny", "short", "silent", "silver", "simple",
    "sleepy", "slow", "small", "smooth", "soft", "solid", "sour", "spare", "steady", "steep", "stern", "stiff",
    "strange", "strong", "sturdy", "sudden", "sunny", "sweet", "swift", "tall", "tame", "tender", "thick", "thin",
    "tidy", "tiny", "tired", "vast", "velvet", "violet", "warm", "weary", "wet", "white", "wide", "wild", "wise",
    "wooden", "young", "zealous",
)

NOUNS = (
    "acorn", "anchor", "apple", "apron", "arch", "arrow", "attic", "badge", "bakery", "balcony", "ball", "banner",
    "barn", "barrel", "basket", "beacon", "bean", "bear", "bell", "bench", "berry", "bicycle", "bird", "blanket",
    "boat", "bonnet", "book", "boot", "bottle", "boulder", "bowl", "box", "branch", "bread", "brick", "bridge",
    "broom", "bucket", "button", "cabin", "cake", "camel", "candle", "canoe", "canyon", "cap", "captain", "carpet",
    "cart", "castle", "cat", "cave", "cellar", "chair", "chalk", "cherry", "chest", "chimney", "circle", "cliff",
    "clock", "cloud", "coat", "coin", "comet", "compass", "cookie", "copper", "cottage", "cotton", "crane", "crate",
    "creek", "crown", "crystal", "cup", "curtain", "cushion", "daisy", "deer", "desert", "desk", "diamond",
    "dinner", "doctor", "dog", "dolphin", "door", "dragon", "drawer", "drum", "duck", "eagle", "engine", "falcon",
    "farmer", "feather", "fence", "fern", "ferry", "field", "fig", "flag", "flame", "flute", "forest", "fountain",
    "fox", "frog", "garden", "gate", "giraffe", "glove", "goat", "goose", "grape", "guitar", "hammer", "harbor",
    "harp", "hat", "hawk", "hedge", "helmet", "hill", "hive", "horse", "island", "jacket", "jar", "jewel", "kettle",
    "key", "kitchen", "kite", "ladder", "lake", "lamp", "lantern", "leaf", "lemon", "letter", "library", "lily",
    "lion", "lizard", "map", "marble", "market", "meadow", "melon", "mill", "mirror", "mountain", "mouse", "mug",
    "nail", "needle", "nest", "net", "ocean", "olive", "orchard", "otter", "owl", "paddle", "palace", "panda",
    "parrot", "path", "peach", "pearl", "pebble", "pencil", "pepper", "piano", "pillow", "pine", "pitcher",
    "planet", "plate", "plum", "pond", "pony", "porch", "pot", "puppet", "quilt", "rabbit", "radish", "raft",
    "rainbow", "raven", "ribbon", "river", "road", "robin", "rocket", "roof", "rope", "rose", "saddle", "sail",
    "sailor", "salmon", "sandal", "scarf", "school", "shell", "shelf", "ship", "shovel", "sled", "snail",
    "sparrow", "spoon", "squirrel", "stable", "staircase", "star", "statue", "stone", "stove", "stream", "sugar",
    "suitcase", "swan", "sword", "table", "teapot", "tent", "thimble", "thread", "tiger", "tomato", "tower",
    "trail", "train", "tree", "trumpet", "tulip", "tunnel", "turtle", "umbrella", "valley", "vase", "village",
    "violin", "wagon", "wall", "walnut", "wand", "well", "whale", "wheel", "whistle", "willow", "window", "wolf",
    "yard", "zebra",
)

# Past tense, transitive: every haystack template reads "<subject> <verb> <object>".
VERBS = (
    "admired", "borrowed", "built", "buried", "carried", "carved", "chased", "cleaned", "climbed", "collected",
    "covered", "crossed", "dropped", "dusted", "examined", "fixed", "followed", "found", "gathered", "guarded",
    "held", "hid", "lifted", "lost", "measured", "mended", "moved", "noticed", "opened", "packed", "painted",
    "passed", "picked", "placed", "polished", "pulled", "pushed", "raised", "reached", "repaired", "rolled",
    "sketched", "sold", "sorted", "spotted", "studied", "swept", "tied", "touched", "traded", "visited", "washed",
    "watched", "wrapped", "weighed",
)
