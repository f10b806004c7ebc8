"""Tools around the training runs, not part of them: the corpus builders (the built-in espeak-ng
corpus, Debian's recorded prompts) and the metrics plotter.

Imports run one way: recipes → tools → common; common/ never imports tools/."""
