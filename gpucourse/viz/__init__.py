"""What a learner sees, where several chapters share it: static charts (plots), tables and their one formatting rule
(tables), timelines and scaling figures (timeline), interactive widgets (widgets), quick checks (quiz), numeric
problems checked by the course's models (problems). Every figure kind has one home here, or in the one chapter's
module that draws it (gpucourse/chapters/); notebooks call them by name.
"""
