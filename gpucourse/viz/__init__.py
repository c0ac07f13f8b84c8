"""What a learner sees: static charts (plots), timelines and scaling figures (timeline), interactive widgets
(widgets), quick checks (quiz), numeric problems checked by the course's models (problems). Every figure kind has
one home here; notebooks call them by name.
"""
