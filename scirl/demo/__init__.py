"""The offline demo: a small model with a bad answering habit, made-up questions it can learn, and
``scirl demo`` (evaluate, train, evaluate again, report).

May import: any layer except ``scirl.commands``.
"""
