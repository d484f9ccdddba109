"""Pictures of coloured shapes, drawn with PIL, and chat rows asking about them: the image-text demo's data.

`write_picture_rows(folder, count)` writes `count` pictures and a JSONL file of rows as TRL's convention has them
(messages with an image part, an `images` column of paths relative to the file). Each picture's shape, colour and
question are drawn each on its own, so that no one of them tells another. `demo_pictures()` is the embedded demo's
data, made once into the cache: training rows, and pictures the training never sees, asked about before and after.
"""

import json
import random
from pathlib import Path

from moai_recipes.files import demo_pictures_dir, made_once
from moai_recipes.models.tiny_vision import COLOURS, QUESTIONS, SHAPES, answer


def draw(shape: str, colour: str, *, size: int = 56, seed: int = 0):
    """A picture of one coloured shape on a white ground, placed and sized a little differently by `seed`."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (size + rng.randrange(0, 29), size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    r = rng.randrange(size // 4, size // 3)
    cx, cy = rng.randrange(r, image.width - r), rng.randrange(r, size - r)
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = COLOURS[colour]
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def write_picture_rows(folder: Path, count: int, *, seed: int = 0, size: int | tuple[int, int] = 56,
                       name: str = "pictures") -> Path:
    """`count` rows of a picture, a question about it (its shape or its colour) and the answer; returns the file.
    `size`: the pictures' height in pixels, or (lowest, highest) for pictures of sizes drawn between them."""
    folder = Path(folder)
    (folder / name).mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        shape, colour, kind = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(QUESTIONS))
        path = f"{name}/{i}.png"
        high = size if isinstance(size, int) else rng.randrange(size[0], size[1] + 1)
        draw(shape, colour, seed=seed * 100_003 + i, size=high).save(folder / path)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[kind]}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer(kind, shape, colour)}]}],
            "images": [path]})
    out = folder / f"{name}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


# The demo's pictures (files.demo_pictures_dir): 2,000 to learn from, 112 pixels high (16 image tokens each for the
# tiny model); and a few the training never sees, asked about before and after it.
DEMO_ROWS, DEMO_SIZE = 2000, 112
UNSEEN = [("circle", "blue"), ("triangle", "yellow"), ("square", "red"), ("triangle", "green")]


def demo_pictures() -> Path:
    """The folder of the image-text demo's data (shapes.jsonl and its pictures; unseen/COLOUR-SHAPE.png, named for
    what they show so that a reader of the answers can tell), made once."""
    def make(tmp: Path) -> None:
        write_picture_rows(tmp, DEMO_ROWS, seed=0, size=DEMO_SIZE, name="shapes")
        (tmp / "unseen").mkdir()
        for i, (shape, colour) in enumerate(UNSEEN):
            draw(shape, colour, seed=10_000_000 + i, size=DEMO_SIZE).save(tmp / "unseen" / f"{colour}-{shape}.png")

    return made_once(demo_pictures_dir(), make)


def made_if_demo(path: str) -> None:
    """The demo's pictures drawn, if `path` is among them and they are not yet (the config names them by path,
    config/compose.py's ${pictures:NAME}, before anything draws them)."""
    if Path(path).resolve().is_relative_to(demo_pictures_dir().resolve()):
        demo_pictures()
