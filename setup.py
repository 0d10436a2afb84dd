"""Build hook: ship ``fp4offload-auto.pth`` at the top of site-packages (everything else is in pyproject.toml).

The .pth line imports ``_fp4offload_auto`` at interpreter start, which routes ``deepspeed.initialize`` through
fp4offload when deepspeed is first imported (docs/design.md section 5). setuptools has no key for a file at
the root of the wheel's purelib, so build_py copies it there; the editable wheel is given it by EditableWheelWithPth.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "fp4offload-auto.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):
        return {**super().get_output_mapping(), os.path.join(self.build_lib, PTH): PTH}


class EditableWheelWithPth(editable_wheel):
    """``pip install -e .``: the editable wheel gets the same .pth (its own strategy writes only the finder)."""

    def _select_strategy(self, name, tag, build_lib):
        strategy = super()._select_strategy(name, tag, build_lib)

        def write(wheel, files, mapping):
            strategy(wheel, files, mapping)
            with open(PTH, encoding="utf-8") as f:
                wheel.writestr(PTH, f.read())

        class Strategy:
            def __call__(self, wheel, files, mapping):
                write(wheel, files, mapping)

            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc):
                return strategy.__exit__(*exc)

        return Strategy()


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
