#include "quartic.hpp"
