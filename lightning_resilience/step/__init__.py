"""The step path: one ordered step end (:mod:`.driver`), one non-blocking agreement (:mod:`.agreement`), and the
side groups the suite's components share (:mod:`.channels`)."""
