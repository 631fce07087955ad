"""Small NER files for the token-classification tests: a vocab whose entity names split into
sub-words, tagged sentences (IOB2) and CoNLL-2003's layout."""
from megabert.corpus.tokenizer_training import BERT_SPECIALS
from megabert.tasks.ner.data import Sentence

NAMES = {"PER": ["alice", "bob", "carol", "dave"], "LOC": ["paris", "rome", "oslo"], "ORG": ["acme", "globex"]}
FILLER = [f"w{i}" for i in range(24)]


def write(path, text):
    path.write_text(text)
    return str(path)


def write_vocab(path) -> str:
    """Entity names that split into sub-words: "alicezz" is alice ##zz."""
    words = [w for names in NAMES.values() for w in names] + FILLER + ["##zz", "##z", "."]
    path.write_text("\n".join(BERT_SPECIALS + words) + "\n")
    return str(path)


def tagged_sentences(rng, n, longest=9):
    """Filler words with names of three classes (IOB2), some names of several words or sub-words."""
    out = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(2, longest)):
            if rng.random() < 0.25:
                kind = rng.choice(sorted(NAMES))
                for j in range(rng.randint(1, 2)):
                    words.append(rng.choice(NAMES[kind]) + ("zz" if rng.random() < 0.3 else ""))
                    tags.append(("B-" if j == 0 else "I-") + kind)
            else:
                words.append(rng.choice(FILLER))
                tags.append("O")
        out.append(Sentence(tuple(words), tuple(tags)))
    return out


def conll(sentences, docstart=True):
    """CoNLL-2003's layout: token POS chunk tag."""
    blocks = ["\n".join(f"{w} NN I-NP {t}" for w, t in zip(s.words, s.tags)) for s in sentences]
    return ("-DOCSTART- -X- -X- O\n\n" if docstart else "") + "\n\n".join(blocks) + "\n"
