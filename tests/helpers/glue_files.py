"""GLUE-style files written line by line, as the distribution ships them."""


def write(path, lines):
    """`lines` joined with newlines into `path` (a pathlib.Path); returns its str."""
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)
