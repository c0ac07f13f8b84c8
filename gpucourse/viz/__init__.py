"""What a learner sees: static charts (plots), timelines and scaling figures (timeline), interactive widgets
(widgets), quick checks (quiz). Every figure kind has one home here; notebooks call them by name.
"""
