// placeholder, replaced by the solver
#pragma once
