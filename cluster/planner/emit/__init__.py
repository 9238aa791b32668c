"""What the planner writes: the cluster spec and the reports.

    spec_writer.py    plan_spec / write_spec (checked with the cluster's own schema), spec_model, model_notes
    report.py         report.md, attainment.png, plan.json of `pdserve plan`
    design_report.py  report.md, designs.png, designs.json of the design search

matplotlib is imported lazily by the reports only.
"""
