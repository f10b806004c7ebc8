"""Tools around the training runs, not part of them: the built-in corpus synthesizer and the metrics plotter.

Imports run one way: recipes → tools → common; common/ never imports tools/."""
